"""The experiments behind ``docs/simulation.md``, reproducible with one command:

    python -m megatron_odyssey.sim.experiments [--seeds 20] [--write-docs] [--only PART]

1. the Odyssey paper's simulation (§V-B: 32 NPUs, Llama-2-7B, 10% failures per NPU-hour, 9 h):
   mean and spread over seeds of odyssey/oobleck and odyssey/recycle next to the paper's 1.229 / 1.355;
2. replay of the two shared spot traces;
3. ReCycle's fidelity table (GPT-3 Medium on 32 A100s, (PP, DP) in (2,16), (4,8), (8,4), one failure
   every 6 h / 2 h / 30 min for 6 h): our ReCycle and Oobleck next to the published 98.9/92.2/80.7 %
   and 98.8/92.0/70.6 % of fault-free throughput (slides' table: 27.27, 25.42, 22.27 and 27.26, 25.37,
   19.47 samples/s against 27.58 fault-free), plus the same with other batches and with a larger
   Oobleck reconfiguration overhead (sensitivity).

4. fail-slow (issue 15): the paper setting with fail-slow episodes (``failslow.py``: Greyhound's rates,
   durations and factors) added, Odyssey's three ways of handling a slow node (Eq. 8 via ``decide_slow``,
   ignore, treat as failed) next to ReCycle and Oobleck (which do not detect fail-slow); plot
   docs/fail_slow.png.

``--write-docs`` replaces the text between ``<!-- results:start -->`` and ``<!-- results:end -->`` in
docs/simulation.md with the tables of parts 1-3, and between ``<!-- fail-slow:start -->`` and
``<!-- fail-slow:end -->`` with part 4 (``--only fail-slow --write-docs`` rewrites that block alone).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from .config import SimulationConfig
from .events import EventStream
from .failslow import FAIL_SLOW_PRESETS, describe
from .result import SimulationResult
from .runner import event_stream, run_simulation

PAPER_RATIOS = {"odyssey/oobleck": 1.229, "odyssey/recycle": 1.355}
RECYCLE_TABLE = {  # % of fault-free (27.58 samples/s), from papers/recycle-slides.txt Table 1, GPT-3 Medium
    "recycle": {6.0: 27.27 / 27.58, 2.0: 25.42 / 27.58, 0.5: 22.27 / 27.58},
    "oobleck": {6.0: 27.26 / 27.58, 2.0: 25.37 / 27.58, 0.5: 19.47 / 27.58},
}
GRIDS = ((2, 16), (4, 8), (8, 4))
INTERVALS = (6.0, 2.0, 0.5)
INTERVAL_LABELS = {6.0: "6 h", 2.0: "2 h", 0.5: "30 min"}
PAPER_POLICIES = ("odyssey", "odyssey-f1", "oobleck", "recycle", "recycle-nofill", "checkpoint", "fault-scaled")


def _ms(xs: list[float]) -> str:
    if len(xs) < 2:
        return f"{xs[0]:.3f}"
    return f"{statistics.fmean(xs):.3f} ± {statistics.stdev(xs):.3f}"


def paper_reproduction(seeds: int, batches=(16, 32, 64)) -> str:
    rows = ["| global batch | odyssey/oobleck | odyssey/recycle | odyssey/recycle-nofill | odyssey-f1/oobleck | "
            "odyssey-f1/recycle | odyssey/fault-scaled |", "|---|---|---|---|---|---|---|"]
    frac_rows = ["| global batch | " + " | ".join(PAPER_POLICIES) + " |", "|---" * (len(PAPER_POLICIES) + 1) + "|"]
    for b in batches:
        res = run_simulation(SimulationConfig(global_batch=b, seeds=seeds, progress=False, policies=PAPER_POLICIES))
        cells = []
        for num, den in (("odyssey", "oobleck"), ("odyssey", "recycle"), ("odyssey", "recycle-nofill"),
                         ("odyssey-f1", "oobleck"), ("odyssey-f1", "recycle"), ("odyssey", "fault-scaled")):
            xs = res.seed_ratios(num, den)
            cells.append(f"{_ms(xs)} [{min(xs):.2f}, {max(xs):.2f}]")
        rows.append(f"| {b} | " + " | ".join(cells) + " |")
        ff = res.fault_free_throughput
        frac_rows.append(f"| {b} | " + " | ".join(
            f"{100 * res.policies[p].avg_throughput / ff:.1f}" for p in PAPER_POLICIES) + " |")
    rows.append(f"| paper | {PAPER_RATIOS['odyssey/oobleck']} | {PAPER_RATIOS['odyssey/recycle']} | | | | |")
    return ("Ratios of average throughput, mean ± std over seeds of the per-seed ratio [min, max]:\n\n"
            + "\n".join(rows) + "\n\nAverage throughput in % of fault-free (mean over seeds):\n\n" + "\n".join(frac_rows))


def trace_replay(seeds: int, traces=("ec2-p3-spot.csv", "ec2-g4dn-spot.csv"),
                 folder: str = "/work/shared/traces") -> str:
    policies = ("odyssey", "odyssey-f1", "oobleck", "recycle", "checkpoint", "fault-scaled")
    rows = ["| trace | hours | " + " | ".join(policies) + " | odyssey/oobleck | odyssey/recycle |",
            "|---" * (len(policies) + 4) + "|"]
    for name in traces:
        path = str(Path(folder) / name)
        from .traces import load_trace
        hours = load_trace(path).duration_s / 3600
        res = run_simulation(SimulationConfig(trace=path, hours=hours, seeds=seeds, progress=False, policies=policies))
        cells = [f"{res.policies[p].avg_throughput:.2f} ({100 * res.policies[p].avg_throughput / res.fault_free_throughput:.0f}%)"
                 for p in policies]
        rows.append(f"| {name} | {hours:.1f} | " + " | ".join(cells) + " | "
                    + " | ".join(f"{_ms(xs)} [{min(xs):.3f}]" for xs in (res.seed_ratios('odyssey', 'oobleck'),
                                                                          res.seed_ratios('odyssey', 'recycle'))) + " |")
    return ("Average samples/s (and % of the 32-node job's fault-free throughput), mean over seeds (the seed "
            "permutes which trace node takes which grid position); ratios: mean ± std of the per-seed ratio "
            "[worst seed]:\n\n" + "\n".join(rows))


def recycle_table(seeds: int, global_batch: int = 8192, micro_batch: int = 16) -> tuple[str, dict]:
    policies = ("recycle", "oobleck", "odyssey", "odyssey-f1", "fault-scaled")
    got: dict[tuple[str, float, tuple[int, int]], float] = {}
    worst: dict[tuple[float, tuple[int, int]], tuple[float, float]] = {}  # odyssey over recycle, over oobleck
    for pp, dp in GRIDS:
        for iv in INTERVALS:
            res = run_simulation(SimulationConfig(
                npus=32, tp=1, pp=pp, dp=dp, model="gpt3-medium-a100", global_batch=global_batch,
                micro_batch=micro_batch, failure_rate=None, failure_interval_h=iv, hours=6.0, seeds=seeds,
                progress=False, policies=policies))
            for p in policies:
                got[(p, iv, (pp, dp))] = 100 * res.policies[p].avg_throughput / res.fault_free_throughput
            worst[(iv, (pp, dp))] = (min(res.seed_ratios("odyssey", "recycle")),
                                     min(res.seed_ratios("odyssey", "oobleck")))
    head = ("| system | failure every | paper | ours (2,16) | ours (4,8) | ours (8,4) | ours mean | mean - paper |\n"
            "|---|---|---|---|---|---|---|---|")
    rows = [head]
    for p in policies:
        for iv in INTERVALS:
            vals = [got[(p, iv, g)] for g in GRIDS]
            mean = statistics.fmean(vals)
            paper = RECYCLE_TABLE.get(p, {}).get(iv)
            ptxt = f"{100 * paper:.1f}" if paper else ""
            dtxt = f"{mean - 100 * paper:+.1f}" if paper else ""
            rows.append(f"| {p} | {INTERVAL_LABELS[iv]} | {ptxt} | " + " | ".join(f"{v:.1f}" for v in vals) +
                        f" | {mean:.1f} | {dtxt} |")
    rows += ["", "Worst seed of each cell, odyssey/recycle and odyssey/oobleck (per-seed ratio of average throughput):",
             "", "| failure every | " + " | ".join(f"({pp},{dp})" for pp, dp in GRIDS) + " |", "|---" * (len(GRIDS) + 1) + "|"]
    for iv in INTERVALS:
        rows.append(f"| {INTERVAL_LABELS[iv]} | " + " | ".join("{:.3f} / {:.3f}".format(*worst[(iv, g)]) for g in GRIDS) + " |")
    return "\n".join(rows), got


def oobleck_rebuild_sensitivity(seeds: int, rebuilds=(60.0, 120.0, 180.0, 240.0)) -> str:
    """ReCycle's table for Oobleck alone with a larger reconfiguration overhead (``oobleck_rebuild_s``)."""
    rows = ["| Oobleck rebuild (s) | 6 h | 2 h | 30 min |", "|---|---|---|---|"]
    for x in rebuilds:
        cells = []
        for iv in INTERVALS:
            vals = []
            for pp, dp in GRIDS:
                res = run_simulation(SimulationConfig(
                    npus=32, tp=1, pp=pp, dp=dp, model="gpt3-medium-a100", global_batch=8192, micro_batch=16,
                    failure_rate=None, failure_interval_h=iv, hours=6.0, seeds=seeds, progress=False,
                    policies=("oobleck",), oobleck_rebuild_s=x))
                vals.append(100 * res.policies["oobleck"].avg_throughput / res.fault_free_throughput)
            cells.append(f"{statistics.fmean(vals):.1f}")
        rows.append(f"| {x:g} | " + " | ".join(cells) + " |")
    paper = RECYCLE_TABLE["oobleck"]
    rows.append("| paper (measured) | " + " | ".join(f"{100 * paper[iv]:.1f}" for iv in INTERVALS) + " |")
    return "\n".join(rows)


FAIL_SLOW_POLICIES = ("odyssey", "odyssey-ignore-slow", "odyssey-slow-as-failure", "recycle", "oobleck")
FAIL_SLOW_SETTINGS = {  # preset -> what it is
    "greyhound": "Greyhound's published rates, durations and factors",
    "greyhound-x10": "the same, rates x10 (stress; our assumption)",
    "greyhound-severe": "at-scale factors 5-10x, mean 72 min, at the communication rate",
}
SLOW_LABELS = {"odyssey": "odyssey (Eq. 8)", "odyssey-ignore-slow": "odyssey-ignore-slow",
               "odyssey-slow-as-failure": "odyssey-slow-as-failure", "recycle": "recycle (ignores)",
               "oobleck": "oobleck (ignores)"}


def slow_spans(stream: EventStream) -> list[tuple[float, float, int]]:
    """``(start_s, end_s, slow live nodes)`` wherever at least one live node is slow."""
    slow: dict[int, float] = {}
    out: list[tuple[float, float, int]] = []
    t_prev = 0.0
    for e in list(stream.events) + [None]:
        t = stream.horizon_s if e is None else e.time_s
        if slow and t > t_prev:
            out.append((t_prev, t, len(slow)))
        if e is None:
            break
        for n in e.removed:
            slow.pop(n, None)
        for n, f in e.slowdown:
            (slow.__setitem__(n, f) if f > 1.0 else slow.pop(n, None))
        t_prev = t
    return out


def slow_onsets(stream: EventStream) -> int:
    """Episodes that start on a live node (a factor rising from 1)."""
    slow: set[int] = set()
    count = 0
    for e in stream.events:
        slow -= e.removed
        for n, f in e.slowdown:
            if f > 1.0 and n not in slow:
                count += 1
            (slow.add if f > 1.0 else slow.discard)(n)
    return count


def _slow_actions(res: SimulationResult, policy: str) -> tuple[float, float]:
    """Mean per seed of the slow-node rebalances and drops ``policy`` made (readmissions not counted)."""
    runs = res.policies[policy].runs
    reb = sum(1 for r in runs for x in r.reactions if x.kind == "rebalance" and not x.note.startswith("readmit"))
    drop = sum(1 for r in runs for x in r.reactions if x.note.startswith("drop slow"))
    return reb / len(runs), drop / len(runs)


def fail_slow_comparison(seeds: int, plot_path: Path | None = None) -> str:
    """The paper setting (32 NPUs, (4,8,1), 10%/NPU-h failures, 9 h, batch 64) with fail-slow episodes added."""
    results: dict[str, SimulationResult] = {}
    onsets: dict[str, list[int]] = {}
    for preset in FAIL_SLOW_SETTINGS:
        cfg = SimulationConfig(seeds=seeds, progress=False, policies=FAIL_SLOW_POLICIES, fail_slow=preset)
        results[preset] = run_simulation(cfg)
        onsets[preset] = [slow_onsets(event_stream(cfg, s)) for s in results[preset].seeds]
    reference = run_simulation(SimulationConfig(seeds=seeds, progress=False, policies=("odyssey",)))
    classes = "; ".join(f"**{p}**: {describe(FAIL_SLOW_PRESETS[p])}" for p in FAIL_SLOW_SETTINGS)
    parts = [f"Fail-slow classes: {classes}",
             "Average throughput in % of fault-free (mean over seeds), and the per-seed ratios of Odyssey's "
             "Eq. 8 choice to the other two ways (mean ± std):\n\n" + _fail_slow_summary(results, onsets, reference),
             f"Average samples/s per seed (fault-free: {reference.fault_free_throughput:.3f}):\n\n"
             + _fail_slow_seeds(results, reference)]
    if plot_path is not None:
        from .plots import plot_fail_slow

        shown = "greyhound-severe"
        cfg = SimulationConfig(seeds=1, progress=False, policies=FAIL_SLOW_POLICIES, fail_slow=shown)
        spans = slow_spans(event_stream(cfg, results[shown].seeds[0]))
        plot_fail_slow(results, reference, shown, spans, plot_path)
    return "\n\n".join(parts)


def _fail_slow_summary(results: dict[str, SimulationResult], onsets: dict[str, list[int]],
                       reference: SimulationResult) -> str:
    """One row per setting: episodes, % of fault-free per policy, Eq. 8's ratios and actions."""
    ff = reference.fault_free_throughput
    n = len(FAIL_SLOW_POLICIES)
    rows = ["| fail-slow | episodes / seed | " + " | ".join(SLOW_LABELS[p] for p in FAIL_SLOW_POLICIES)
            + " | Eq. 8 / ignore | Eq. 8 / as-failure | Eq. 8 rebalances, drops / seed |", "|---" * (n + 5) + "|"]
    ref = 100 * reference.policies["odyssey"].avg_throughput / ff
    rows.append(f"| none (failures only) | 0 | {ref:.1f} |" + " |" * (n + 2))
    for preset, res in results.items():
        cells = " | ".join(f"{100 * res.policies[p].avg_throughput / ff:.1f}" for p in FAIL_SLOW_POLICIES)
        reb, drop = _slow_actions(res, "odyssey")
        rows.append(f"| {preset} | {statistics.fmean(onsets[preset]):.1f} | {cells} | "
                    f"{_ms(res.seed_ratios('odyssey', 'odyssey-ignore-slow'))} | "
                    f"{_ms(res.seed_ratios('odyssey', 'odyssey-slow-as-failure'))} | {reb:.1f}, {drop:.1f} |")
    return "\n".join(rows)


def _fail_slow_seeds(results: dict[str, SimulationResult], reference: SimulationResult) -> str:
    """Every policy's average samples/s on every seed."""
    rows = ["| fail-slow | policy | " + " | ".join(f"seed {s}" for s in reference.seeds) + " | mean |",
            "|---" * (len(reference.seeds) + 3) + "|"]
    runs = [("none", "odyssey", reference)] + [(k, p, r) for k, r in results.items() for p in FAIL_SLOW_POLICIES]
    for preset, p, res in runs:
        xs = [r.avg_throughput for r in res.policies[p].runs]
        rows.append(f"| {preset} | {p} | " + " | ".join(f"{x:.3f}" for x in xs) + f" | {statistics.fmean(xs):.3f} |")
    return "\n".join(rows)


def _write_block(doc: Path, name: str, body: str) -> None:
    """Replace the text between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` in ``doc``."""
    text = doc.read_text()
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(head + start + "\n" + body + "\n" + end + tail)


def fail_slow_part(seeds: int, doc: Path | None) -> None:
    """Print part 4; with ``doc``, write it into its block there and the plot beside it."""
    t0 = time.time()
    plot = doc.parent / "fail_slow.png" if doc is not None else None
    body = (f"### Fail-slow (32 NPUs, Llama-2-7B, (4,8,1), 10%/NPU-h failures, 9 h, batch 64, {seeds} seeds)\n\n"
            + fail_slow_comparison(seeds, plot)
            + f"\n\n(generated by `python -m megatron_odyssey.sim.experiments --only fail-slow --fail-slow-seeds "
            f"{seeds} --write-docs`, {time.time() - t0:.0f} s)")
    print(body, flush=True)
    if doc is not None:
        _write_block(doc, "fail-slow", body)
        print(f"wrote {doc} and {plot}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run the simulator experiments of docs/simulation.md")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--trace-seeds", type=int, default=5)
    ap.add_argument("--fail-slow-seeds", type=int, default=5)
    ap.add_argument("--write-docs", action="store_true",
                    help="replace the results section (needs every part) and the fail-slow section")
    ap.add_argument("--traces-dir", default="/work/shared/traces")
    ap.add_argument("--only", choices=("paper", "traces", "recycle", "recycle-batch", "oobleck-rebuild", "fail-slow"),
                    action="append")
    args = ap.parse_args(argv)
    if args.write_docs and args.only and args.only != ["fail-slow"]:
        ap.error("--write-docs rewrites the whole results section: run it without --only (or with --only fail-slow)")
    doc = Path(__file__).resolve().parents[2] / "docs" / "simulation.md"
    parts = []
    t0 = time.time()
    only = set(args.only or ("paper", "traces", "recycle", "recycle-batch", "oobleck-rebuild", "fail-slow"))
    if "fail-slow" in only:
        fail_slow_part(args.fail_slow_seeds, doc if args.write_docs else None)
        only.discard("fail-slow")
        if not only:
            return 0
        t0 = time.time()
    if "paper" in only:
        parts.append("### Odyssey paper §V-B (32 NPUs, Llama-2-7B, (PP,DP,TP) = (4,8,1), 10%/NPU-h, 9 h, "
                     f"{args.seeds} seeds)\n\n" + paper_reproduction(args.seeds))
        print(parts[-1], flush=True)
    if "traces" in only:
        parts.append(f"### Spot-trace replay (32-node job, Llama-2-7B, (4,8,1), batch 64, {args.trace_seeds} seeds)\n\n"
                     + trace_replay(args.trace_seeds, folder=args.traces_dir))
        print(parts[-1], flush=True)
    if "recycle" in only:
        table, _ = recycle_table(args.seeds)
        parts.append("### ReCycle's table (GPT-3 Medium, 32 A100s, global batch 8192 = 512 micro-batches of 16, "
                     f"6 h, {args.seeds} seeds; % of fault-free throughput)\n\n" + table)
        print(parts[-1], flush=True)
    if "recycle-batch" in only:
        for mbs in (64, 256):
            table, _ = recycle_table(max(5, args.seeds // 2), global_batch=mbs * 16, micro_batch=16)
            parts.append(f"### Sensitivity: the same with {mbs} micro-batches of 16 per step "
                         f"({max(5, args.seeds // 2)} seeds)\n\n" + table)
            print(parts[-1], flush=True)
    if "oobleck-rebuild" in only:
        parts.append("### Oobleck with a larger reconfiguration overhead (ReCycle's setting, mean of the three "
                     f"grids, {args.seeds} seeds)\n\n" + oobleck_rebuild_sensitivity(args.seeds))
        print(parts[-1], flush=True)
    body = "\n\n".join(parts) + f"\n\n(generated by `python -m megatron_odyssey.sim.experiments`, {time.time() - t0:.0f} s)"
    if args.write_docs:
        _write_block(doc, "results", body)
        print(f"wrote {doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
