"""The ``odyssey`` command. Subcommands register themselves here; each keeps its logic in its layer.

Bad input exits with code 2 and one line, ``odyssey SUB: error: ...``, naming the flag the user typed.
When argparse itself rejects the command line (an unknown or missing flag, a value of the wrong type
or range), that line follows the subcommand's usage; every other error is the one line alone.
``plan`` and ``simulate`` never import torch.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable

from .cli_args import UsageError, ensure_folder, non_negative_float, positive_float, positive_int
from .planning.cluster import ClusterSpec, parse_node_list
from .planning.errors import PlanningError
from .planning.exhaustive import SearchTooLarge, describe_count, describe_seconds
from .planning.fit import Grid, explain_misfit, fits, suggest_layout
from .planning.models import BUILTIN_MODELS, DEFAULT_MODEL, builtin_help, resolve_profile
from .planning.plan import symmetric_plan
from .planning.planner import DEFAULT_MTBF_HOURS, SEARCH_MODES, Planner, PlannerOptions

EXIT_BAD_INPUT = 2


# -- plan -----------------------------------------------------------------------------------------

def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="choose the recovery plan for a set of failed nodes",
                       description="Build the best reroute / reconfigure / restart plan after failures and "
                                   "choose one by Odyssey's Eq. 8.")
    p.add_argument("--nodes", type=positive_int, required=True, metavar="N",
                   help="nodes in the job (a node is one TP group of --tp devices): must equal --pp x --dp")
    p.add_argument("--tp", type=positive_int, default=1, metavar="T",
                   help="tensor-parallel size: devices per node (default 1)")
    p.add_argument("--pp", type=positive_int, required=True, metavar="P", help="pipeline stages of the launched job")
    p.add_argument("--dp", type=positive_int, required=True, metavar="D",
                   help="data-parallel replicas (pipelines) of the launched job")
    p.add_argument("--layers", type=positive_int, required=True, metavar="L",
                   help="transformer layers (at least --pp: every stage needs one)")
    p.add_argument("--global-batch", type=positive_int, required=True, metavar="B",
                   help="samples per step, kept the same by every plan (divisible by --micro-batch x --dp)")
    p.add_argument("--micro-batch", type=positive_int, required=True, metavar="b", help="samples per micro-batch")
    p.add_argument("--failed", default="", metavar="I,J,...",
                   help="failed node ids, comma-separated, each once; node of stage s in replica d = s x DP + d "
                        "(default: none)")
    p.add_argument("--profile", default=None, metavar="FILE|NAME",
                   help=f"profile JSON file, or a built-in model: {builtin_help()} (default {DEFAULT_MODEL})")
    p.add_argument("--mtbf-hours", type=positive_float, default=DEFAULT_MTBF_HOURS, metavar="H",
                   help="mean time between failures of one device, in hours (default: Llama 3's ~50,000)")
    p.add_argument("--search", choices=SEARCH_MODES, default="heuristic",
                   help="heuristic (Algorithm 1, milliseconds) or exhaustive (an oracle for small jobs; refused "
                        "when estimated over 60 s unless --time-limit is given) (default heuristic)")
    p.add_argument("--time-limit", type=positive_float, default=None, metavar="SECONDS",
                   help="with --search exhaustive: stop after SECONDS and report the best plan found so far, "
                        "marked as cut short")
    p.add_argument("--json", action="store_true", help="print the decision as JSON (no progress output)")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from .planning.report import SearchProgress, print_decision

    cluster = ClusterSpec(tp=args.tp, pp=args.pp, dp=args.dp, num_layers=args.layers,
                          global_batch=args.global_batch, micro_batch=args.micro_batch,
                          failed=parse_node_list(args.failed))
    if args.nodes != cluster.num_nodes:
        raise UsageError(f"--nodes {args.nodes} does not match --pp x --dp = {args.pp} x {args.dp} = "
                         f"{cluster.num_nodes} (a node is one TP group of --tp {args.tp} device(s))")
    if args.time_limit is not None and args.search != "exhaustive":
        raise UsageError("--time-limit bounds --search exhaustive only; the heuristic search takes milliseconds")
    profile = resolve_profile(args.profile, args.layers, args.tp, args.micro_batch)
    _check_plan_fits(args, profile, cluster.num_micro_batches)
    options = PlannerOptions(search=args.search, mtbf_hours=args.mtbf_hours, tp=args.tp, time_limit_s=args.time_limit)
    planner = Planner(profile, cluster.global_batch, cluster.micro_batch, options,
                      on_search_progress=None if args.json else SearchProgress())
    current = symmetric_plan(cluster.pp, cluster.dp, cluster.num_layers, cluster.num_micro_batches)
    try:
        decision = planner.decide(current, cluster.failed)
    except SearchTooLarge as exc:
        st = exc.status
        raise UsageError(f"--search exhaustive would score {describe_count(st)} layouts ({st.splits_total:.3g} layer "
                         f"splits), estimated {describe_seconds(st.estimated_s)} of CPU, over {exc.budget_s:g} s: add "
                         "--time-limit SECONDS to stop there with the best plan found, or use --search heuristic") from None
    except PlanningError as exc:  # e.g. no plan fits the survivors: the failures named are the input at fault
        raise UsageError(f"--failed {args.failed or 'none'}: {exc}") from None
    if args.json:
        print(json.dumps(decision.to_json(), indent=1))
    else:
        print_decision(decision)
    return 0


def _check_plan_fits(args: argparse.Namespace, profile, num_micro_batches: int) -> None:
    """The launched grid must fit memory; if it does not, say which grid would."""
    if fits(profile, args.pp, args.dp, num_micro_batches):
        return

    def profile_for_tp(tp: int):
        if tp == args.tp:
            return profile
        if args.profile is not None and args.profile not in BUILTIN_MODELS:
            return None  # a file is measured at one TP size
        return resolve_profile(args.profile, args.layers, tp, args.micro_batch)

    devices = args.nodes * args.tp
    suggestion = suggest_layout(profile_for_tp, devices, num_micro_batches, args.dp)
    raise UsageError(explain_misfit(profile, Grid(args.tp, args.pp, args.dp), num_micro_batches, suggestion,
                                    "--nodes", lambda g: g.pp * g.dp, label=args.profile or DEFAULT_MODEL))


# -- simulate -------------------------------------------------------------------------------------

def _add_simulate(sub: argparse._SubParsersAction) -> None:
    from .sim import DEFAULT_POLICIES, FAIL_SLOW_PRESETS, POLICY_NAMES

    p = sub.add_parser("simulate", help="compare Odyssey, ReCycle, Oobleck, checkpoint restart under failures",
                       description="Event-driven simulation of one training job under a failure process or a trace. "
                                   "Give the failure process explicitly: --failure-rate R or --trace FILE.")
    p.add_argument("--npus", type=positive_int, required=True, metavar="N",
                   help="devices in the job: must equal --tp x --pp x --dp")
    p.add_argument("--tp", type=positive_int, default=1, metavar="T", help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=positive_int, required=True, metavar="P", help="pipeline stages of the launched job")
    p.add_argument("--dp", type=positive_int, required=True, metavar="D",
                   help="data-parallel replicas (pipelines) of the launched job")
    failures = p.add_mutually_exclusive_group(required=True)
    failures.add_argument("--failure-rate", type=non_negative_float, default=None, metavar="R",
                          help="Poisson failures per device-hour (the Odyssey paper's setting: 0.1)")
    failures.add_argument("--trace", default=None, metavar="FILE",
                          help="replay a spot trace instead: lines 'time_ms,add|remove,nodeNAME'; "
                               "the events at time 0 build the cluster")
    p.add_argument("--fail-slow", default="none", choices=tuple(FAIL_SLOW_PRESETS), metavar="PRESET",
                   help="fail-slow (straggler) episodes laid over the failures: "
                        f"{', '.join(FAIL_SLOW_PRESETS)} (default none; see docs/simulation.md)")
    p.add_argument("--hours", type=positive_float, required=True, metavar="H", help="simulated time per seed")
    p.add_argument("--seeds", type=positive_int, default=1, metavar="K",
                   help="independent runs (seeds 0..K-1); results are means over them (default 1)")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES), metavar="A,B,...",
                   help=f"policies to compare, comma-separated, from: {', '.join(POLICY_NAMES)} "
                        f"(default {','.join(DEFAULT_POLICIES)})")
    p.add_argument("--model", default=None, metavar="NAME",
                   help=f"built-in model: {builtin_help()} (default {DEFAULT_MODEL})")
    p.add_argument("--profile", default=None, metavar="FILE|NAME",
                   help="profile JSON instead of --model (or a built-in name, as odyssey plan --profile takes)")
    p.add_argument("--global-batch", type=positive_int, default=64, metavar="B",
                   help="samples per step (divisible by --micro-batch x --dp; default 64)")
    p.add_argument("--micro-batch", type=positive_int, default=1, metavar="b",
                   help="samples per micro-batch (default 1)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="folder for result.json, per-policy CSV time series, devices.png and throughput.png")
    p.add_argument("--json", action="store_true", help="print the result as JSON (no progress bar)")
    p.set_defaults(func=cmd_simulate)


def cmd_simulate(args: argparse.Namespace) -> int:
    from .sim import (SimulationConfig, SimulationError, load_trace, parse_policies, print_summary, run_simulation,
                      write_outputs)

    try:
        if args.model is not None and args.profile is not None:
            raise UsageError(f"give --model or --profile, not both (got --model {args.model} "
                             f"--profile {args.profile})")
        policies = parse_policies(args.policies)
        if args.out:
            ensure_folder("--out", args.out)
        trace = None
        if args.trace:
            try:
                trace = load_trace(args.trace)
            except SimulationError as exc:
                raise UsageError(f"--trace {exc}") from None
        cfg = SimulationConfig(npus=args.npus, tp=args.tp, pp=args.pp, dp=args.dp, failure_rate=args.failure_rate,
                               trace=args.trace, hours=args.hours, seeds=args.seeds, policies=policies,
                               model=args.model or DEFAULT_MODEL, profile=args.profile,
                               global_batch=args.global_batch, micro_batch=args.micro_batch,
                               fail_slow=args.fail_slow, progress=not args.json)
        result = run_simulation(cfg, trace=trace)
    except SimulationError as exc:
        raise UsageError(str(exc)) from None
    if args.out:
        write_outputs(result, args.out)
    if args.json:
        out = result.to_json()
        print(out if isinstance(out, str) else json.dumps(out, indent=1))
    else:
        print_summary(result)
    return 0


# -- train / demo ---------------------------------------------------------------------------------

def _add_train_and_demo(sub: argparse._SubParsersAction) -> None:
    from .train_cli import register  # imports no torch until a command runs

    register(sub)


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_plan, _add_simulate, _add_train_and_demo]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="odyssey", description="Adaptive fault tolerance for Megatron-LM training")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of one subcommand (for its usage line in errors)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    raise KeyError(command)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:  # argparse would report them against the top-level usage; the subcommand's is the useful one
        subparser(parser, args.command).error(f"unrecognized arguments: {' '.join(extras)}")
    try:
        return args.func(args)
    except (PlanningError, UsageError) as exc:
        message = " ".join(str(exc).split())  # one line, whatever the message holds
        print(f"odyssey {args.command}: error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # `odyssey plan --json | head`: the reader left; not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
