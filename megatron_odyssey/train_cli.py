"""``odyssey train`` and ``odyssey demo``: real multi-process training that survives killed ranks.

Kept out of ``cli.py`` so ``odyssey plan`` and ``odyssey simulate`` never import torch.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .runtime.config import TrainConfig


def add_train_arguments(p: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    d = defaults
    p.add_argument("--nproc", type=int, default=d.nproc, help="processes (devices) in the job")
    p.add_argument("--tp", type=int, default=d.tp)
    p.add_argument("--pp", type=int, default=d.pp)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--seq", type=int, default=d.seq)
    p.add_argument("--global-batch", type=int, default=d.global_batch)
    p.add_argument("--micro-batch", type=int, default=d.micro_batch)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--fail", action="append", default=list(d.fail), metavar="SPEC",
                   help="inject a fault: step=5,rank=3,phase=forward|backward|grad-sync|optimizer|recovery,"
                        "kind=kill|hang|slow|error (repeatable; error: the rank raises, as a local bug would)")
    p.add_argument("--policy", choices=("auto", "reroute", "reconfigure"), default=d.policy)
    p.add_argument("--save-params", default=d.save_params, help="write the gathered fp32 state dict here")
    p.add_argument("--report", default=d.report, help="write the JSON report here")
    p.add_argument("--plan", default=None, help="run this plan JSON instead of the symmetric PP x DP layout")
    p.add_argument("--data-path", default=d.data_path, help="Megatron indexed dataset prefix (default: mock data)")
    p.add_argument("--checkpoint-interval", type=int, default=d.checkpoint_interval)
    p.add_argument("--heartbeat-timeout", type=float, default=d.heartbeat_timeout_s)
    p.add_argument("--mtbf-hours", type=float, default=d.mtbf_hours, help="per-device MTBF for the policy choice")
    p.add_argument("--workdir", default=None, help="logs and checkpoints (default: a temporary folder)")
    p.add_argument("--shared-device", action="store_true", default=d.shared_device,
                   help="let every rank use the same GPU/NPU (for testing failures on a one-device machine): "
                        "ranks then communicate over gloo, staging point-to-point messages through host memory")
    p.add_argument("--profile-out", default=None,
                   help="measure every layer's forward/backward time and bytes; write a planner profile JSON")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    plan = json.loads(Path(args.plan).read_text()) if args.plan else None
    return TrainConfig(nproc=args.nproc, tp=args.tp, pp=args.pp, layers=args.layers, hidden=args.hidden,
                       heads=args.heads, seq=args.seq, global_batch=args.global_batch, micro_batch=args.micro_batch,
                       steps=args.steps, seed=args.seed, fail=list(args.fail), policy=args.policy,
                       save_params=args.save_params, report=args.report, plan=plan, data_path=args.data_path,
                       checkpoint_interval=args.checkpoint_interval, heartbeat_timeout_s=args.heartbeat_timeout,
                       mtbf_hours=args.mtbf_hours, workdir=args.workdir, profile_out=args.profile_out,
                       shared_device=args.shared_device)


def cmd_train(args: argparse.Namespace) -> int:
    from .standalone.launcher import TrainingFailed, is_torchrun_worker, launch, run_under_torchrun

    cfg = config_from_args(args)
    if is_torchrun_worker():
        run_under_torchrun(cfg)
        return 0
    try:
        launch(cfg, args.workdir)
    except TrainingFailed as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


# -- demo -------------------------------------------------------------------------------------------

DEMO = TrainConfig(nproc=8, tp=1, pp=2, layers=8, hidden=64, heads=4, seq=32, global_batch=16, micro_batch=1,
                   steps=12, seed=1234, checkpoint_interval=4, mtbf_hours=0.0035,
                   fail=["step=3,rank=5,phase=backward,kind=kill", "step=7,rank=7,phase=forward,kind=kill"])


def cmd_demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .runtime.data import build_indexed_dataset
    from .standalone.launcher import TrainingFailed, launch

    console = Console(width=None if sys.stdout.isatty() else 160)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config_from_args(args)
    if cfg.data_path is None:
        console.print("[bold]building the demo dataset[/] (Megatron indexed .bin/.idx from the shipped corpus)")
        cfg.data_path = build_indexed_dataset(str(out / "demo_corpus"))
    cfg.report = str(out / "report.json")
    cfg.save_params = str(out / "params.pt")
    console.print(f"[bold]training[/] {cfg.nproc} ranks (PP={cfg.pp} x DP={cfg.nproc // cfg.pp}), {cfg.layers}-layer "
                  f"Llama-2-shaped model, {cfg.steps} steps; faults: {', '.join(cfg.fail)}")
    t0 = time.time()
    try:
        launch(cfg, out / "run")
    except TrainingFailed as exc:
        console.print(f"[red]{exc}")
        return 1
    console.print(f"[bold]fault-free reference[/] (one process, same batches) for the loss comparison")
    ref_cfg = out / "reference_config.json"
    cfg.save(ref_cfg)
    subprocess.run([sys.executable, "-m", "megatron_odyssey.testing.reference", "--config", str(ref_cfg),
                    "--out", str(out / "reference.pt")], check=True, capture_output=True)
    import torch

    reference = torch.load(out / "reference.pt")
    params = torch.load(out / "params.pt")
    report = json.loads(Path(cfg.report).read_text())
    worst = max((params[k] - reference["params"][k]).abs().max().item() for k in params)
    report["reference_losses"] = reference["losses"]
    report["max_param_diff_vs_fault_free"] = worst
    Path(cfg.report).write_text(json.dumps(report, indent=1))
    print_summary(console, report, worst, time.time() - t0)
    plot_report(report, out / "report.png", cfg.global_batch)
    console.print(f"wrote {out / 'report.json'} and {out / 'report.png'}")
    return 0


def print_summary(console, report: dict, worst: float, wall_s: float) -> None:
    from rich.table import Table

    table = Table(title="Failures and recoveries")
    for col in ("step", "ranks", "phase", "policy", "detection (s)", "decision (ms)", "transfer (s)", "recovery (s)",
                "candidates (step s / transition s / score)"):
        table.add_column(col)
    for f in report["failures"]:
        cands = "; ".join(f"{c['policy']}: {c['step_time_s'] or math.nan:.3g}/{c['transition_time_s'] or math.nan:.3g}/"
                          f"{c['score']:.0f}" for c in f["candidates"])
        table.add_row(str(f["step"]), str(f["ranks"]), f["phase"], f"[bold]{f['policy']}", f"{f['detection_s']:.3f}",
                      f"{f['decision_s'] * 1e3:.1f}", f"{f['transfer_s']:.3f}", f"{f['recovery_s']:.2f}", cands)
    console.print(table)
    steps = Table(title="Steps")
    for col in ("step", "devices", "policy", "loss", "fault-free loss", "time (s)"):
        steps.add_column(col)
    ref = report["reference_losses"]
    for s in report["steps"]:
        steps.add_row(str(s["step"]), str(s["alive"]), s["policy"], f"{s['loss']:.6f}", f"{ref[s['step']]:.6f}",
                      f"{s['time_s']:.3f}")
    console.print(steps)
    console.print(f"final parameters vs fault-free training: max |diff| = {worst:.2e} "
                  f"({'identical within 1e-5' if worst < 1e-5 else 'DIFFERENT'}); wall time {wall_s:.0f} s")


def plot_report(report: dict, path: Path, global_batch: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = report["steps"]
    wall = [s["wall_s"] for s in steps]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    # the rate over each wall-clock interval ending at a commit: a recovery shows as a dip
    rates = [global_batch / max(b - a, 1e-9) for a, b in zip([steps[0]["wall_s"] - steps[0]["time_s"]] + wall, wall)]
    axes[0].step(wall, rates, where="pre")
    axes[0].set(xlabel="wall time (s)", ylabel="samples / s", title="Throughput (8 ranks share 2 CPU cores)")
    axes[1].step(wall, [s["alive"] for s in steps], where="post", color="tab:red")
    axes[1].set(xlabel="wall time (s)", ylabel="devices", title="Devices alive")
    for f in report["failures"]:
        for ax in axes[:2]:
            ax.axvline(next((s["wall_s"] for s in steps if s["step"] >= f["step"]), wall[-1]), ls=":", color="grey")
    axes[2].plot([s["step"] for s in steps], [s["loss"] for s in steps], "o-", label="with failures")
    axes[2].plot(range(len(report["reference_losses"])), report["reference_losses"], "x--", label="fault-free")
    axes[2].set(xlabel="step", ylabel="loss", title="Loss vs fault-free run")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def register(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser("train", help="train on N local ranks (or one torchrun rank), surviving failures")
    add_train_arguments(train, TrainConfig())
    train.set_defaults(func=cmd_train)
    demo = sub.add_parser("demo", help="the main job: train, kill a rank (reroute), kill another (reconfigure)")
    add_train_arguments(demo, DEMO)
    demo.add_argument("--out", default="odyssey-demo", help="output folder (report.json, report.png)")
    demo.set_defaults(func=cmd_demo)
