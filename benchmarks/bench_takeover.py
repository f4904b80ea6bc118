"""The control plane survives its machine: what the standby agent costs fault-free, and how fast it takes over.

    python benchmarks/bench_takeover.py [--repeats 3] [--steps 8] [--write docs/benchmarks.md]
        [--plot docs/takeover.png]

Real ``odyssey train`` jobs of the recovery tests' model (6 CPU ranks, PP=2 x DP=3, forked by the agent):

- *fault-free*, without and with ``--standby-agent``: the median step time (steps 2 on; the agent writes
  its state into the standby's store ahead of every commit, one round trip);
- *kill-agent*: the agent's process is SIGKILLed in step 3's backward pass; the standby's detection (kill to
  takeover) and recovery (kill to the first step committed after it: every rank moved to the standby's
  store, the same layout rebuilt on new groups);
- *kill-with-agent*: the agent and rank 0 die together (one machine held both): the standby finds rank 0
  dead and the planner recovers without it.

Medians over ``--repeats`` runs of each.
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

START, END = "<!-- bench_takeover:start -->", "<!-- bench_takeover:end -->"
NOTE = ("On one machine (`odyssey train --standby-agent`) the standby sees the agent's process end (its pid), so "
        "detection takes one poll (50 ms); across machines (`odyssey-launch`, the standby on machine 1) it waits "
        "until the agent's store has not answered for 2 s. *kill-agent* loses no rank: every rank moves its store "
        "client to the standby, the step in flight is redone, and the same layout is rebuilt on new groups. "
        "*kill-with-agent* also loses rank 0, found dead by its exit (on one machine) or its silent heartbeat (across "
        "machines: `--odyssey-heartbeat-timeout` + 10 s). Each run's parameters and losses equal a fault-free run's "
        "(tests/runtime/test_control_plane.py); the write-ahead costs one store round trip per step, lost in the "
        "noise here.")
MODEL = dict(nproc=6, pp=2, layers=6, hidden=32, heads=4, seq=16, global_batch=12, micro_batch=1, seed=11)


def run(steps: int, standby: bool, fail: list[str]) -> dict:
    work = Path(tempfile.mkdtemp(prefix="odyssey-takeover-"))
    cfg = TrainConfig(**MODEL, steps=steps, fail=fail, report=str(work / "report.json"),
                      extra={"control": {}} if standby else {})
    t0 = time.perf_counter()
    launch(cfg, work / "run", quiet=True)
    report = json.loads((work / "report.json").read_text())
    report["wall_s"] = time.perf_counter() - t0
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--write", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args(argv)
    cases = {"fault-free": (False, []), "fault-free, standby": (True, []),
             "kill-agent": (True, ["step=3,rank=2,phase=backward,kind=kill-agent"]),
             "kill-with-agent": (True, ["step=3,rank=0,phase=backward,kind=kill-with-agent"])}
    results: dict[str, list[dict]] = {name: [] for name in cases}
    for i in range(args.repeats):  # interleaved: a slow spell of the machine hits every case alike
        for name, (standby, fail) in cases.items():
            report = run(args.steps, standby, fail)
            results[name].append(report)
            step = statistics.median(s["time_s"] for s in report["steps"][2:])
            over = report["takeovers"][0] if report["takeovers"] else {}
            print(f"[{i + 1}/{args.repeats}] {name}: median step {step * 1e3:.1f} ms"
                  + (f", detection {over['detection_s']:.2f} s, recovery {over['recovery_s']:.2f} s "
                     f"({over['policy']})" if over else ""), flush=True)

    def step_ms(name: str) -> float:
        return statistics.median(statistics.median(s["time_s"] for s in r["steps"][2:]) for r in results[name]) * 1e3

    def takeover(name: str, key: str) -> float:
        return statistics.median(r["takeovers"][0][key] for r in results[name])

    plain, with_standby = step_ms("fault-free"), step_ms("fault-free, standby")
    rows = [f"| fault-free step, no standby | {plain:.1f} ms | |",
            f"| fault-free step, with the standby agent | {with_standby:.1f} ms | {with_standby / plain:.2f}x |"]
    for name in ("kill-agent", "kill-with-agent"):
        policies = sorted({r["takeovers"][0]["policy"] for r in results[name]})
        rows.append(f"| {name}: kill -> takeover (detection) | {takeover(name, 'detection_s'):.2f} s | |")
        rows.append(f"| {name}: kill -> first step after it ({'/'.join(policies)}) | "
                    f"{takeover(name, 'recovery_s'):.2f} s | |")
    table = ["| what | median | ratio |", "|---|---:|---:|", *rows]
    print("\n".join(table))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
        a.bar(["no standby", "with standby"], [plain, with_standby], color=["tab:grey", "tab:blue"])
        a.set(ylabel="median step time (ms)", title="Fault-free cost of the standby")
        names = ["kill-agent", "kill-with-agent"]
        xs = range(len(names))
        b.bar([x - 0.2 for x in xs], [takeover(n, "detection_s") for n in names], 0.4, label="kill -> takeover")
        b.bar([x + 0.2 for x in xs], [takeover(n, "recovery_s") for n in names], 0.4,
              label="kill -> first step after it")
        b.set_xticks(list(xs), ["agent killed", "agent + rank 0 killed"])
        b.set(ylabel="seconds (median)", title="Takeover by the standby agent")
        b.legend()
        fig.suptitle(f"odyssey train, 6 CPU ranks, medians of {args.repeats} runs")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
    if args.write:
        body = "\n".join([START, "## The control plane survives its machine (standby agent)", "",
                          f"`python benchmarks/bench_takeover.py --repeats {args.repeats} --steps {args.steps}"
                          + (f" --plot {args.plot}" if args.plot else "") + f"`, on {platform.node()} "
                          f"({MODEL['nproc']} CPU ranks, PP=2 x DP=3, medians of {args.repeats} runs).", "", *table,
                          "", "" if not args.plot else f"![takeover]({args.plot.name})", NOTE, END])
        write_section(args.write, body, START, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
