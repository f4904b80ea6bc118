"""``odyssey train`` and ``odyssey demo``: real multi-process training that survives killed ranks.

Kept out of ``cli.py`` so ``odyssey plan`` and ``odyssey simulate`` never import torch.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .arguments import POLICIES
from .cli_args import UsageError, ensure_folder
from .planning.errors import read_user_file
from .runtime.config import SLOW_ACTION_CHOICES, TrainConfig


def add_train_arguments(p: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    d = defaults

    def number(flag: str, kind: type, value: object, what: str) -> None:
        p.add_argument(flag, type=kind, default=value, help=f"{what} (default {value})")

    number("--nproc", int, d.nproc, "processes (devices) in the job")
    number("--tp", int, d.tp, "tensor-parallel size: ranks per node")
    number("--pp", int, d.pp, "pipeline stages; DP = nproc / (TP x PP)")
    number("--layers", int, d.layers, "transformer layers")
    number("--hidden", int, d.hidden, "hidden size")
    number("--heads", int, d.heads, "attention heads")
    number("--seq", int, d.seq, "sequence length in tokens")
    number("--global-batch", int, d.global_batch, "samples per step, kept the same through failures")
    number("--micro-batch", int, d.micro_batch, "samples per micro-batch")
    number("--steps", int, d.steps, "training steps")
    number("--seed", int, d.seed, "initialisation and data seed")
    p.add_argument("--fail", action="append", default=None, metavar="SPEC",
                   help="inject a fault: step=5,rank=3,phase=forward|backward|grad-sync|optimizer|recovery,"
                        "kind=kill|hang|stall|slow|slow-link|error|crash (repeatable; error: the rank raises, as a "
                        "local bug would; crash: it segfaults in native code; slow,factor=F: its compute F times "
                        "slower from that step on, steps=N: for N steps; "
                        "slow-link,factor=F: its messages held back as on a slow link; exit,code=C: no fault, the "
                        "script ends the job with its own code C, which odyssey train then leaves with)"
                        + (f"; replaces the built-in faults ({'; '.join(d.fail)}); --fail none: no faults"
                           if d.fail else ""))
    p.add_argument("--policy", choices=POLICIES, default=d.policy,
                   help="auto: the planner chooses by Eq. 8; else force a policy where it is feasible (fill: "
                        "reroute with weight gradients deferred into pipeline bubbles; stagger: fill with each rank "
                        "updating before the commit, ReCycle's staggered optimizer; normalise: a few "
                        "nodes change stage so failures spread, then reroute)")
    p.add_argument("--slow-action", choices=SLOW_ACTION_CHOICES, default=d.slow_action,
                   help="what to do about a node the diagnosis names slow: auto (the planner chooses by Eq. 8 between "
                        "carrying on, rebalancing its pipeline's micro-batches and dropping it), force one of "
                        "none|rebalance|drop where feasible, or off (no slowness diagnosis)")
    p.add_argument("--overlap-grad-reduce", action="store_true", default=d.overlap_grad_reduce,
                   help="start each layer's gradient all-reduce during the step's last backward, as soon as the layer's "
                        "gradients are complete (as Megatron's --overlap-grad-reduce), where the plan allows: not on a "
                        "rank whose last gradient operation is a filled reroute's deferred weight gradient")
    p.add_argument("--rejoin", action="append", default=None, metavar="RANK@STEP",
                   help="a replacement for rank RANK (a repaired machine) comes back once STEP is committed and RANK "
                        "is dead: a fresh process given only the job's address (as `odyssey join` starts one), set up "
                        "when the job starts, asks to join then; the planner decides by Eq. 8 whether to use it now "
                        "or hold it as a standby (repeatable; none: no rejoin)"
                        + (f"; default {', '.join(rejoin_text(d.extra['rejoin']))}" if d.extra.get("rejoin") else ""))
    p.add_argument("--save-params", default=d.save_params, help="write the gathered fp32 state dict here")
    p.add_argument("--report", default=d.report, help="write the JSON report here")
    p.add_argument("--plan", default=None, help="run this plan JSON (an execution plan, or `odyssey plan --json` "
                                                "output) instead of the symmetric PP x DP layout")
    p.add_argument("--data-path", default=d.data_path, help="Megatron indexed dataset prefix (default: mock data)")
    p.add_argument("--hidden-dropout", type=float, default=d.hidden_dropout,
                   help="dropout after attention and MLP (default 0); masks are keyed to the step, micro-batch and "
                        "layer, so a failure does not change them")
    p.add_argument("--attention-dropout", type=float, default=d.attention_dropout,
                   help="dropout of the attention probabilities (default 0); keyed like --hidden-dropout")
    number("--checkpoint-interval", int, d.checkpoint_interval, "steps between checkpoints, 0: never")
    number("--heartbeat-timeout", float, d.heartbeat_timeout_s, "seconds without a heartbeat before a rank is fenced")
    number("--soft-timeout", float, d.soft_timeout_s, "seconds a rank may work inside a step without progress "
                                                      "before it is named and its stacks dumped to its log")
    number("--hard-timeout", float, d.hard_timeout_s, "seconds without progress inside a step before a rank is "
                                                      "fenced (SIGKILL) and the job recovers without it")
    number("--first-step-timeout", float, d.first_step_timeout_s, "seconds a generation's first step (connecting, "
           "allocating, compiling) may take before progress is judged in it too")
    p.add_argument("--mtbf-hours", type=float, default=d.mtbf_hours,
                   help="per-device mean time between failures for the policy choice (default "
                        + (f"{d.mtbf_hours})" if d.mtbf_hours else "the planner's 50,000)"))
    p.add_argument("--workdir", default=None, help="logs and checkpoints (default: a temporary folder, removed "
                                                   "after a clean finish and kept when the job fails)")
    p.add_argument("--shared-device", action="store_true", default=d.shared_device,
                   help="let every rank use the same GPU/NPU (for testing failures on a one-device machine): "
                        "ranks then communicate over gloo, staging point-to-point messages through host memory")
    p.add_argument("--standby-agent", action="store_true",
                   help="run a second agent process that takes over the job (and its ranks) if the agent's process "
                        "is lost; across machines, odyssey-launch runs it on machine 1")
    p.add_argument("--profile-out", default=None,
                   help="measure every layer's forward/backward time and bytes; write a planner profile JSON")


def config_from_args(args: argparse.Namespace, defaults: TrainConfig) -> TrainConfig:
    """The job the flags describe; the flags' own errors (files that cannot be read) name the flag."""
    fail = defaults.fail if args.fail is None else [f for f in args.fail if f.strip().lower() != "none"]
    # the demo's returning rank belongs to its faults: --fail replaces both (give --rejoin again to keep one)
    rejoin = (defaults.extra.get("rejoin", []) if args.fail is None else []) if args.rejoin is None else \
        parse_rejoin([r for r in args.rejoin if r.strip().lower() != "none"])
    return TrainConfig(nproc=args.nproc, tp=args.tp, pp=args.pp, layers=args.layers, hidden=args.hidden,
                       heads=args.heads, seq=args.seq, global_batch=args.global_batch, micro_batch=args.micro_batch,
                       steps=args.steps, seed=args.seed, fail=list(fail), policy=args.policy,
                       slow_action=args.slow_action, overlap_grad_reduce=args.overlap_grad_reduce,
                       save_params=args.save_params, report=args.report, plan=read_plan(args.plan),
                       data_path=args.data_path, checkpoint_interval=args.checkpoint_interval,
                       heartbeat_timeout_s=args.heartbeat_timeout, soft_timeout_s=args.soft_timeout,
                       hard_timeout_s=args.hard_timeout,
                       first_step_timeout_s=args.first_step_timeout, mtbf_hours=args.mtbf_hours, workdir=args.workdir,
                       profile_out=args.profile_out, shared_device=args.shared_device,
                       hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
                       extra={**({"control": {}} if getattr(args, "standby_agent", False) else {}),
                              **({"rejoin": rejoin} if rejoin else {})})


def rejoin_text(rejoin: list[dict[str, int]]) -> list[str]:
    return [f"{r['rank']}@{r['after_step']}" for r in rejoin]


def parse_rejoin(specs: list[str]) -> list[dict[str, int]]:
    """``--rejoin R@S`` -> [{"rank": R, "after_step": S}]."""
    from .arguments import OdysseyArgumentError, parse_rejoin as parse

    try:
        return parse(specs)
    except OdysseyArgumentError as exc:
        raise UsageError(str(exc)) from None


def read_plan(path: str | None) -> dict | None:
    """``--plan``: an execution plan's JSON, or ``odyssey plan --json``'s decision (its ``plan`` is taken)."""
    if path is None:
        return None
    text = read_user_file(path, f"--plan {path}", "an execution plan's JSON")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--plan {path}: not JSON ({exc})") from None
    if isinstance(data, dict) and "pipelines" not in data and isinstance(data.get("plan"), dict):
        data = data["plan"]
    if not isinstance(data, dict):
        raise UsageError(f"--plan {path}: expected a JSON object (an execution plan), got {type(data).__name__}")
    return data


def check_outputs(args: argparse.Namespace) -> None:
    """Files the job writes at its end must be writable at its start, not after an hour of training."""
    for flag in ("save_params", "report", "profile_out"):
        path = getattr(args, flag, None)
        if path is None:
            continue
        folder = Path(path).resolve().parent
        if not folder.is_dir():
            raise UsageError(f"--{flag.replace('_', '-')} {path}: folder {folder} does not exist")
        if not os.access(folder, os.W_OK):
            raise UsageError(f"--{flag.replace('_', '-')} {path}: folder {folder} is not writable")
    for flag in ("workdir", "out"):
        if getattr(args, flag, None) is not None:
            ensure_folder(f"--{flag}", getattr(args, flag))


def cmd_train(args: argparse.Namespace) -> int:
    from .standalone.launcher import NOT_UNDER_TORCHRUN, TrainingFailed, is_torchrun_worker, launch

    if is_torchrun_worker():
        raise UsageError(NOT_UNDER_TORCHRUN)
    check_outputs(args)
    cfg = config_from_args(args, TrainConfig())
    try:
        launch(cfg, args.workdir)
    except TrainingFailed as exc:
        print(exc, file=sys.stderr)
        return exc.code  # (as the agent left: a wrapper that relaunches on the script's own code sees it)
    return 0


# -- demo -------------------------------------------------------------------------------------------

DEMO = TrainConfig(nproc=8, tp=1, pp=2, layers=8, hidden=64, heads=4, seq=32, global_batch=16, micro_batch=1,
                   steps=30, seed=1234, checkpoint_interval=4, mtbf_hours=0.0035,
                   fail=["step=3,rank=5,phase=backward,kind=kill", "step=7,rank=7,phase=forward,kind=kill",
                         "step=14,rank=2,kind=slow,factor=4"],
                   extra={"rejoin": [{"rank": 5, "after_step": 5}]})


def cmd_demo(args: argparse.Namespace) -> int:
    from .planning.report import terminal_console
    from .runtime.data import build_indexed_dataset
    from .standalone.launcher import TrainingFailed, launch
    from .standalone.report_view import plot_report, print_summary

    console = terminal_console()
    check_outputs(args)
    out = Path(args.out)
    cfg = config_from_args(args, DEMO)
    cfg.report = cfg.report or str(out / "report.json")
    cfg.save_params = cfg.save_params or str(out / "params.pt")
    cfg.validate()  # before building the dataset
    if cfg.data_path is None:
        console.print("[bold]building the demo dataset[/] (Megatron indexed .bin/.idx from the shipped corpus)")
        cfg.data_path = build_indexed_dataset(str(out / "demo_corpus"))
    faults = "; ".join(cfg.fail) or "none"
    console.print(f"[bold]training[/] {cfg.nproc} ranks (PP={cfg.pp} x DP={cfg.dp}), {cfg.layers}-layer "
                  f"Llama-2-shaped model, {cfg.steps} steps; faults: {faults}")
    t0 = time.time()
    try:
        launch(cfg, Path(args.workdir) if args.workdir else out / "run")
    except TrainingFailed as exc:
        console.print(f"[red]{exc}", soft_wrap=True)
        return 1
    console.print("[bold]fault-free reference[/] (one process, same batches) for the loss comparison")
    import torch

    from .testing.reference import reference_in_subprocess

    try:
        reference = reference_in_subprocess(cfg, out)
    except RuntimeError as exc:
        console.print(str(exc), style="red", soft_wrap=True, markup=False)
        return 1
    params = torch.load(cfg.save_params)
    report = json.loads(Path(cfg.report).read_text())
    worst = max((params[k] - reference["params"][k]).abs().max().item() for k in params)
    report["reference_losses"] = reference["losses"]
    report["max_param_diff_vs_fault_free"] = worst
    Path(cfg.report).write_text(json.dumps(report, indent=1))
    print_summary(console, report, cfg.global_batch, time.time() - t0)
    picture = Path(cfg.report).with_suffix(".png")
    plot_report(report, picture)
    console.print(f"wrote {cfg.report} and {picture}")
    return 0


def cmd_join(args: argparse.Namespace) -> int:
    from .runtime.joining import ADDRESS_FILE, main as join_main

    address = args.address
    if address is None:
        path = Path(args.workdir) / ADDRESS_FILE
        try:
            address = path.read_text().strip()
        except OSError as exc:
            raise UsageError(f"--workdir {args.workdir}: no job address in {path} ({exc.strerror}); is the job "
                             f"running with this --workdir?") from None
    join_main(["--address", address, "--rank", str(args.rank)])
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser("train", help="train on N local ranks, surviving failures")
    add_train_arguments(train, TrainConfig())
    train.set_defaults(func=cmd_train)
    demo = sub.add_parser("demo", help="the main job: train, kill a rank (reroute), kill another (reconfigure), slow "
                                       "a third (diagnosed and handled), and bring the first back")
    add_train_arguments(demo, DEMO)
    demo.add_argument("--out", default="odyssey-demo",
                      help="output folder: dataset, rank logs, report.json, report.png, params.pt (default odyssey-demo)")
    demo.set_defaults(func=cmd_demo)
    join = sub.add_parser("join", help="join a running `odyssey train` job as rank R (a machine that came back)")
    where = join.add_mutually_exclusive_group(required=True)
    where.add_argument("--address", help="HOST:PORT of the job's agent (written to <workdir>/agent.address)")
    where.add_argument("--workdir", help="the job's --workdir (its agent.address is read)")
    join.add_argument("--rank", type=int, required=True, help="the rank to join as (a dead rank's, or a new one)")
    join.set_defaults(func=cmd_join)
