"""Long runs stay flat: the agent's memory and the coordination store's key count over 10,000 steps.

    python benchmarks/bench_long_run.py [--steps 10000] [--nproc 4] [--write docs/benchmarks.md]
        [--plot docs/long_run.png]

A real job (agent, forked ranks, gloo, the per-step commit protocol) in the runtime's sleep mode with
zero-length sleeps, so each step is nothing but the protocol: executor messages, per-layer gradient
sync, *ready*, *commit*. The agent records, with every committed step, the store's key count and its own
resident memory (it hosts the store, so that memory includes the store's); the benchmark reads them from
the report. Flat means: the second half of the run never holds more keys than steps 100-999 did (a step's
*ready* keys come and go), and the agent's memory grows by less than 5 % from step 1,000 to the last.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from docs_section import write_section
from megatron_odyssey.runtime.config import TrainConfig
from megatron_odyssey.standalone.launcher import launch

START, END = "<!-- bench_long_run:start -->", "<!-- bench_long_run:end -->"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--write", type=Path, default=None, help="replace this benchmark's section of the file")
    p.add_argument("--plot", type=Path, default=None, help="draw keys and memory against steps")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="odyssey-long-run-"))
    report_path = work / "report.json"
    cfg = TrainConfig(nproc=args.nproc, pp=2, layers=2, hidden=8, heads=1, seq=4, global_batch=args.nproc // 2,
                      micro_batch=1, steps=args.steps, sleep_forward_s=0.0, sleep_backward_s=0.0,
                      checkpoint_interval=0, report=str(report_path))
    t0 = time.perf_counter()
    launch(cfg, work / "run", quiet=True)
    wall = time.perf_counter() - t0
    steps = json.loads(report_path.read_text())["steps"]
    by = {s["step"]: s for s in steps}
    marks = [m for m in (100, 1000, 2000, 5000, args.steps - 1) if m in by]
    rows = [(m, by[m]["store_keys"], by[m]["agent_rss_mb"]) for m in marks]
    step_ms = statistics.median(s["time_s"] for s in steps[1:]) * 1e3
    # flat: no more keys late than early (a step's ready keys come and go: up to one per rank in flight)
    early = max(s["store_keys"] for s in steps if 100 <= s["step"] < 1000)
    late = max(s["store_keys"] for s in steps if s["step"] >= args.steps // 2)
    flat_keys = late <= early
    grow = rows[-1][2] / by[1000]["agent_rss_mb"] - 1 if 1000 in by else float("nan")
    lines = ["| step | store keys | agent RSS (MB) |", "|---:|---:|---:|"]
    lines += [f"| {m:,} | {k} | {r:.1f} |" for m, k, r in rows]
    summary = (f"{args.steps:,} steps, {args.nproc} ranks (PP=2 x DP={args.nproc // 2}), median step "
               f"{step_ms:.1f} ms, {wall:.0f} s in all; most keys in steps 100-999: {early}, in the second half: {late}; "
               f"agent memory from step 1,000 to the "
               f"last: {grow * 100:+.1f} %")
    print("\n".join(lines))
    print(summary)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
        xs = [s["step"] for s in steps]
        a.plot(xs, [s["store_keys"] for s in steps], color="tab:blue")
        a.set(xlabel="step", ylabel="keys in the coordination store", title="Store keys per committed step",
              ylim=(0, max(s["store_keys"] for s in steps) * 1.3))
        b.plot(xs, [s["agent_rss_mb"] for s in steps], color="tab:orange")
        b.set(xlabel="step", ylabel="agent resident memory (MB)", title="Agent memory (hosts the store)",
              ylim=(0, max(s["agent_rss_mb"] for s in steps) * 1.3))
        fig.suptitle(f"{args.steps:,} steps of the commit protocol, {args.nproc} ranks, sleep mode")
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)
    if args.write:
        body = "\n".join([START, "## Long runs stay flat (store keys, agent memory)", "",
                          f"`python benchmarks/bench_long_run.py --steps {args.steps} --nproc {args.nproc}"
                          + (f" --plot {args.plot}" if args.plot else "") + "`, "
                          f"on {platform.node()} ({platform.processor() or platform.machine()}).", "",
                          *lines, "", summary + ".", "",
                          "Before this change every step left one `ready` key per rank and one `commit` key in the "
                          "store for ever (about 5 keys per step here: 50,000 at 10,000 steps) and the agent kept "
                          "every step's record in memory until the end.",
                          "" if not args.plot else f"\n![store keys and agent memory]({args.plot.name})\n", END])
        write_section(args.write, body, START, END)
    return 0 if flat_keys else 1


if __name__ == "__main__":
    sys.exit(main())
