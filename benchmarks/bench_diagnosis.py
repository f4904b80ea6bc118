"""Fail-slow diagnosis (issue 15): how fast a slow rank or link is named, how often a clean run names anyone,
and what the monitoring costs per step, on the demo's job, in one run.

    python benchmarks/bench_diagnosis.py [--steps 40] [--write docs/benchmarks.md] [--plot docs/diagnosis.png]

Detection: rank 5 slowed (``--fail kind=slow,factor=F``, busy: its compute takes F times as long) or its
link slowed (``kind=slow-link,factor=F``) from step 4 on, ``--slow-action none`` so the job goes on; latency
= steps and seconds from the slowdown's first operation to the agent naming it. False positives: ranks
named in clean runs. Overhead: median step time with the monitoring on (``--slow-action auto``: every rank
records its operations and ships one JSON value per step; the agent reads and judges them) over off
(``--slow-action off``: nothing recorded), clean runs, alternated so load changes hit both alike.

``--megatron-lm PATH``: the same on Megatron-LM's own ``pretrain_gpt.py`` (the tests' tiny Llama-style GPT,
4 CPU ranks, PP=2 x DP=2) before any failure, where Megatron's own 1F1B runs the compute and moves the
messages; rank 1 slowed (its twin is rank 0), or its link (to rank 3, which it sends activations). Written to
its own section.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from docs_section import write_section
from megatron_odyssey.runtime.config import TrainConfig
from megatron_odyssey.runtime.diagnosis import DiagnosisOptions
from megatron_odyssey.standalone.launcher import launch

JOB = dict(nproc=8, tp=1, pp=2, layers=8, hidden=64, heads=4, seq=32, global_batch=16, micro_batch=1, seed=7,
           checkpoint_interval=0)
SLOW_AT = 4
OPT = DiagnosisOptions()


@dataclass
class Setting:
    """Which job the benchmark runs: ours (``odyssey train``) or Megatron-LM's ``pretrain_gpt.py``."""

    job: Callable[[Path, int, list[str], str], dict]  # (workdir, steps, --fail specs, slow action) -> report
    rank: int  # the rank slowed
    cases: list[tuple[str, float]]
    title: str
    description: str
    markers: tuple[str, str]


def standalone_job(workdir: Path, steps: int, fail: list[str], slow_action: str) -> dict:
    cfg = TrainConfig(**JOB, steps=steps, fail=fail, slow_action=slow_action, report=str(workdir / "report.json"))
    launch(cfg, workdir / "run", quiet=True)
    return json.loads((workdir / "report.json").read_text())


def megatron_lm_job(checkout: str) -> Callable[[Path, int, list[str], str], dict]:
    from megatron_odyssey.megatron_lm.cpu_mode import tiny_gpt_flags
    from megatron_odyssey.runtime.agent import free_port
    from megatron_odyssey.testing.megatron_lm_job import run_odyssey

    def job(workdir: Path, steps: int, fail: list[str], slow_action: str) -> dict:
        flags = [*tiny_gpt_flags(steps), "--odyssey-heartbeat-timeout", "10", "--odyssey-slow-action", slow_action,
                 *(x for f in fail for x in ("--odyssey-inject-fault", f))]
        result = run_odyssey(checkout, workdir, flags, free_port())
        if result.returncode != 0:
            sys.exit(f"the Megatron-LM job failed:\n{result.logs[-3000:]}")
        return result.report

    return job


STANDALONE = Setting(standalone_job, 5, [("slow", 2.0), ("slow", 3.0), ("slow", 4.0), ("slow-link", 20.0)],
                     "Fail-slow diagnosis (issue 15)",
                     "8 CPU ranks (PP=2 x DP=4), the demo's 8-layer model, 16 micro-batches per step. Rank 5 slowed",
                     ("<!-- diagnosis:start -->", "<!-- diagnosis:end -->"))


def megatron_setting(checkout: str) -> Setting:
    return Setting(megatron_lm_job(checkout), 1, [("slow", 2.0), ("slow", 3.0), ("slow", 4.0), ("slow-link", 20.0)],
                   "Fail-slow diagnosis in Megatron-LM's own schedule (before any failure)",
                   "Megatron-LM's `pretrain_gpt.py` (the tests' tiny Llama-style GPT, 4 layers), 4 CPU ranks "
                   "(PP=2 x DP=2), 4 micro-batches per rank and step, Megatron's own 1F1B and DDP (no failure: "
                   "generation 0). Rank 1 slowed",
                   ("<!-- diagnosis-megatron:start -->", "<!-- diagnosis-megatron:end -->"))


def detection(setting: Setting, kind: str, factor: float, steps: int) -> dict:
    rank = setting.rank
    with tempfile.TemporaryDirectory() as d:
        report = setting.job(Path(d), steps, [f"step={SLOW_AT},rank={rank},kind={kind},factor={factor}"], "none")
    want = "slow" if kind == "slow" else "comm-slow"
    named = [x for x in report["diagnoses"] if x["kind"] == want and x["ranks"] == [rank]]
    wrong = [x for x in report["diagnoses"] if x["ranks"] != [rank]]
    first = named[0] if named else None
    return {"case": f"{kind} x{factor:g}", "named": bool(first), "steps": first["step"] - SLOW_AT if first else None,
            "seconds": first["detection_s"] if first else None, "factor": first["factor"] if first else None,
            "false": len(wrong)}


def clean(setting: Setting, steps: int, monitoring: bool) -> dict:
    with tempfile.TemporaryDirectory() as d:
        report = setting.job(Path(d), steps, [], "auto" if monitoring else "off")
    times = [s["time_s"] for s in report["steps"][2:]]  # past start-up and the first (compiling) step
    factors = [s["slowest"]["factor"] for s in report["steps"] if "slowest" in s]
    return {"median_step_s": statistics.median(times), "named": len(report["diagnoses"]),
            "max_factor": max(factors) if factors else None, "steps_judged": len(factors)}


def render(setting: Setting, det: list[dict], on: list[dict], off: list[dict], command: str) -> str:
    ratio = statistics.median(x["median_step_s"] for x in on) / statistics.median(x["median_step_s"] for x in off)
    lines = [setting.markers[0], f"## {setting.title}", "", f"Command: `{command}`  ",
             f"Machine: `{platform.platform()}`, {os.cpu_count()} cores, Python {platform.python_version()}; "
             f"{setting.description} from step {SLOW_AT} on, `--slow-action none`; thresholds: median factor over {OPT.window} steps >= "
             f"{OPT.slow_factor:g} (slow; a median below {OPT.clear_factor:g} only once the median over {OPT.marginal_window} steps "
             f"passes too), a link >= {OPT.link_ratio:g}x the other sources' median delay and >= "
             f"{OPT.link_floor_s * 1e3:.0f} ms (comm-slow). One run.", "",
             "| injected | named | after (steps) | after (s) | measured factor | other ranks named |", "|---|---|---|---|---|---|"]
    for r in det:
        lines.append(f"| {r['case']} | {'yes' if r['named'] else '**no**'} | {r['steps'] if r['named'] else '-'} | "
                     f"{r['seconds'] if r['seconds'] is not None else '-'} | "
                     f"{r['factor'] if r['factor'] is not None else '-'} | {r['false']} |")
    judged = sum(x["steps_judged"] for x in on)
    lines += ["", "| clean runs | median step (s) | ranks named | steps judged | largest per-step factor |",
              "|---|---|---|---|---|"]
    for name, xs in (("monitoring on", on), ("monitoring off", off)):
        lines.append(f"| {name} | {statistics.median(x['median_step_s'] for x in xs):.4f} | "
                     f"{sum(x['named'] for x in xs)} | {sum(x['steps_judged'] for x in xs) if name.endswith('on') else '-'} | "
                     f"{max((x['max_factor'] for x in xs if x['max_factor']), default='-')} |")
    lines += ["", f"Monitoring overhead: median step time on / off = **{ratio:.3f}** ({len(on)} clean runs each, "
              f"alternated). False positives: **{sum(x['named'] for x in on)}** ranks named in {judged} judged steps "
              "of clean runs. Compute is timed with the thread's CPU clock on the CPU (the ranks share 2 cores: wall "
              "time per operation swung 0.2x-2.8x between twins in clean runs, median-of-5 windows still reached "
              "1.7x; the CPU clock keeps clean windows mostly under 1.4x; one CI run saw a clean rank at 1.7x for 5 steps, "
              f"hence the threshold of 2; two saw one at 2.1-2.2x for 3 steps, hence the {OPT.marginal_window} steps "
              f"asked of a median below {OPT.clear_factor:g}).", setting.markers[1]]
    return "\n".join(lines)


def plot(setting: Setting, det: list[dict], on: list[dict], off: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["case"] for r in det]
    a.bar(names, [r["steps"] if r["named"] else 0 for r in det], color=["tab:red" if r["named"] else "0.7" for r in det])
    for i, r in enumerate(det):
        a.text(i, (r["steps"] or 0) + 0.1, f"{r['seconds']} s" if r["named"] else "not named", ha="center", fontsize=9)
    a.axhline(5, ls="--", color="0.4", label="acceptance (issue 15's tests, 4x): within 5 steps")
    a.set(title=f"Steps from the slowdown (step {SLOW_AT}) to the diagnosis", ylabel="steps",
          xlabel=f"injected on rank {setting.rank}")
    a.legend(fontsize=8)
    xs = [x["median_step_s"] for x in off] + [x["median_step_s"] for x in on]
    labels = [f"off #{i + 1}" for i in range(len(off))] + [f"on #{i + 1}" for i in range(len(on))]
    b.bar(labels, xs, color=["0.6"] * len(off) + ["tab:blue"] * len(on))
    b.set(title="Median step time of clean runs, monitoring off vs on", ylabel="seconds per step")
    fig.suptitle(setting.title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--clean-runs", type=int, default=4)
    parser.add_argument("--write", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--megatron-lm", default=None, metavar="PATH",
                        help="run Megatron-LM's pretrain_gpt.py from this checkout instead of odyssey train")
    args = parser.parse_args()
    setting = megatron_setting(args.megatron_lm) if args.megatron_lm else STANDALONE
    det = []
    for kind, factor in setting.cases:
        det.append(detection(setting, kind, factor, max(args.steps // 2, SLOW_AT + 10)))
        print(det[-1], flush=True)
    on, off = [], []
    for i in range(args.clean_runs):  # alternated, and which goes first too: load changes hit both alike
        for monitoring in ((False, True) if i % 2 == 0 else (True, False)):
            (on if monitoring else off).append(clean(setting, args.steps, monitoring))
            print("on" if monitoring else "off", (on if monitoring else off)[-1], flush=True)
    text = render(setting, det, on, off, "python " + " ".join(sys.argv))
    print(text)
    if args.write:
        write_section(args.write, text, *setting.markers)
    if args.plot:
        plot(setting, det, on, off, args.plot)


if __name__ == "__main__":
    main()
