"""The ``odyssey`` command. Subcommands register themselves here; each keeps its logic in its layer."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from .planning.cluster import ClusterSpec, parse_node_list
from .planning.errors import PlanningError
from .planning.plan import symmetric_plan
from .planning.planner import DEFAULT_MTBF_HOURS, SEARCH_MODES, Decision, Planner, PlannerOptions
from .planning.profile import resolve_profile

EXIT_BAD_INPUT = 2


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="choose the recovery plan for a set of failed nodes",
                       description="Build the best reroute / reconfigure / restart plan after failures and "
                                   "choose one by Odyssey's Eq. 8.")
    p.add_argument("--nodes", type=int, required=True, help="nodes (TP groups) in the job: must equal PP x DP")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--dp", type=int, required=True)
    p.add_argument("--layers", type=int, required=True, help="transformer layers")
    p.add_argument("--global-batch", type=int, required=True, help="samples per step")
    p.add_argument("--micro-batch", type=int, required=True, help="samples per micro-batch")
    p.add_argument("--failed", default="", help="failed node ids, comma-separated (node = stage x DP + replica)")
    p.add_argument("--profile", default=None,
                   help="profile JSON file, or a built-in name (llama2-7b, llama2-70b; default llama2-7b on a 910B)")
    p.add_argument("--mtbf-hours", type=float, default=DEFAULT_MTBF_HOURS,
                   help="mean time between failures of one device, in hours (default: Llama 3's ~50,000)")
    p.add_argument("--search", choices=SEARCH_MODES, default="heuristic")
    p.add_argument("--json", action="store_true", help="print the decision as JSON")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    cluster = ClusterSpec(tp=args.tp, pp=args.pp, dp=args.dp, num_layers=args.layers,
                          global_batch=args.global_batch, micro_batch=args.micro_batch,
                          failed=parse_node_list(args.failed))
    if args.nodes != cluster.num_nodes:
        raise PlanningError(f"--nodes {args.nodes} does not match PP x DP = {args.pp} x {args.dp} = "
                            f"{cluster.num_nodes} (a node is one TP group of {args.tp} device(s))")
    profile = resolve_profile(args.profile, args.layers, args.tp, args.micro_batch)
    planner = Planner(profile, cluster.global_batch, cluster.micro_batch,
                      PlannerOptions(search=args.search, mtbf_hours=args.mtbf_hours, tp=args.tp))
    current = symmetric_plan(cluster.pp, cluster.dp, cluster.num_layers, cluster.num_micro_batches)
    decision = planner.decide(current, cluster.failed)
    if args.json:
        print(json.dumps(decision.to_json(), indent=1))
    else:
        print_decision(decision)
    return 0


def print_decision(decision: Decision) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)
    table = Table(title=f"Recovery candidates for failed nodes {sorted(decision.failed) or 'none'}")
    for col in ("policy", "step time (s)", "transition (s)", "score (samples/s)", "note"):
        table.add_column(col)
    for c in decision.candidates:
        mark = "[bold green]* " if c is decision.chosen else "  "
        table.add_row(mark + c.policy, f"{c.step_time_s:.4g}" if c.feasible else "-",
                      f"{c.transition.total_s:.4g}" if c.feasible else "-",
                      f"{c.score:.4g}" if c.feasible else "-", c.reason)
    console.print(table)
    plan = decision.plan
    if plan is None:
        return
    layout = Table(title=f"Chosen plan {plan.plan_id} ({decision.policy})")
    for col in ("pipeline", "micro-batches", "stages: node[layers]"):
        layout.add_column(col)
    for k, p in enumerate(plan.pipelines):
        stages = "  ".join(f"{s.node}{'(dead)' if s.node in plan.failed else ''}[{s.layer_start}-{s.layer_end - 1}]"
                           for s in p.stages)
        layout.add_row(str(k), str(p.micro_batches), stages)
    console.print(layout)
    est = decision.to_json()["estimates"]
    console.print(f"search {decision.search_time_s * 1e3:.1f} ms; gradient sync {est['sync_rounds']} rounds "
                  f"(lower bound {est['sync_lower_bound']}); {est['transfer_bytes'] / 2**30:.2f} GiB to transfer; "
                  f"next failure expected in {decision.time_to_next_failure_s / 3600:.1f} h")


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    from .sim import DEFAULT_POLICIES

    p = sub.add_parser("simulate", help="compare Odyssey, ReCycle, Oobleck, checkpoint restart under failures",
                       description="Event-driven simulation of one training job under a failure process or a trace.")
    p.add_argument("--npus", type=int, required=True, help="devices")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--dp", type=int, required=True)
    p.add_argument("--failure-rate", type=float, default=None, help="failures per device-hour (Poisson)")
    p.add_argument("--trace", default=None, help="replay a spot trace (time_ms,add|remove,nodeNAME) instead")
    p.add_argument("--hours", type=float, required=True)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    p.add_argument("--model", default="llama2-7b", help="built-in model (llama2-7b, llama2-70b, ...)")
    p.add_argument("--profile", default=None, help="profile JSON instead of a built-in model")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--out", default=None, help="folder for result.json, per-policy CSV time series and plots")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_simulate)


def cmd_simulate(args: argparse.Namespace) -> int:
    from .sim import SimulationConfig, SimulationError, parse_policies, print_summary, run_simulation, write_outputs

    if args.failure_rate is None and args.trace is None:
        args.failure_rate = 0.1
    try:
        cfg = SimulationConfig(npus=args.npus, tp=args.tp, pp=args.pp, dp=args.dp, failure_rate=args.failure_rate,
                               trace=args.trace, hours=args.hours, seeds=args.seeds,
                               policies=parse_policies(args.policies), model=args.model, profile=args.profile,
                               global_batch=args.global_batch, micro_batch=args.micro_batch,
                               progress=not args.json)
        result = run_simulation(cfg)
    except SimulationError as exc:
        raise PlanningError(str(exc)) from None
    if args.out:
        write_outputs(result, args.out)
    if args.json:
        out = result.to_json()
        print(out if isinstance(out, str) else json.dumps(out, indent=1))
    else:
        print_summary(result)
    return 0


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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PlanningError as exc:
        print(f"odyssey {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
