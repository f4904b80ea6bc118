"""Everything a person looks at: the terminal table, per-policy time-series CSVs and the two plots
of the Odyssey paper (``plots.py``: Fig. 7, devices over time; Fig. 8, throughput over time).

The time series and plots show the first seed (all seeds use the same format;
``write_outputs(..., all_seeds=True)`` writes every seed's CSV). Policy names are never cut short in
the table: the name column does not wrap, and off a terminal the table is printed wide.
"""
from __future__ import annotations

import csv
from pathlib import Path

from ..planning.report import terminal_console
from .plots import plot_devices, plot_throughput
from .result import CONTRACT_RATIOS, SimulationResult
from .timeline import PolicyRun


CSV_COLUMNS = ("time_s", "devices_alive", "devices_used", "throughput", "state")


def summary_table(result: SimulationResult):
    """A rich Table: one row per policy, means over seeds with spread, then the contract ratios."""
    from rich.table import Table

    n = len(result.seeds)
    table = Table(title=f"odyssey simulate: {n} seed(s), fault-free {result.fault_free_throughput:.3f} samples/s")
    longest = max((len(n) for n in result.policies), default=6)
    table.add_column("policy", justify="left", no_wrap=True, min_width=longest)
    for col in ("avg samples/s", "std", "% fault-free", "samples", "downtime s", "reconfigs"):
        table.add_column(col, justify="right", overflow="fold")
    for name, s in result.policies.items():
        j = s.to_json(result.fault_free_throughput)
        frac = j["fraction_of_fault_free"]
        table.add_row(name, f"{j['avg_throughput']:.3f}", f"{j['avg_throughput_std']:.3f}",
                      f"{100 * frac:.1f}" if frac is not None else "-", f"{j['samples']:.0f}",
                      f"{j['downtime_s']:.0f}", f"{j['reconfigurations']:.1f}")
    for key in CONTRACT_RATIOS:
        r = result.ratio(*key.split("/"))
        if r is not None:
            table.caption = (table.caption + "   " if table.caption else "") + f"{key} = {r:.3f}"
    return table


def print_summary(result: SimulationResult, console=None) -> None:
    """Print the table; off a terminal, wide enough that nothing is truncated."""
    (console or terminal_console()).print(summary_table(result))


def timeseries_rows(run: PolicyRun) -> list[tuple[float, int, int, float, str]]:
    """One row per change point (the series is a step function), plus the horizon."""
    rows = [(s.start_s, s.devices_alive, s.devices_used, s.throughput, s.state) for s in run.segments]
    if run.segments:
        last = run.segments[-1]
        rows.append((last.end_s, last.devices_alive, last.devices_used, last.throughput, last.state))
    return rows


def write_timeseries(run: PolicyRun, path: Path) -> None:
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(CSV_COLUMNS)
        for t, alive, used, thr, state in timeseries_rows(run):
            w.writerow((f"{t:.3f}", alive, used, f"{thr:.6f}", state))


def write_outputs(result: SimulationResult, out_dir: str | Path, all_seeds: bool = False) -> list[Path]:
    """Write ``result.json``, ``timeseries_<policy>.csv`` (first seed, or ``_seed<k>`` for all),
    ``devices.png`` (Fig. 7) and ``throughput.png`` (Fig. 8) into ``out_dir``; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    p = out / "result.json"
    p.write_text(result.to_json())
    written.append(p)
    for name, s in result.policies.items():
        runs = s.runs if all_seeds else s.runs[:1]
        for run in runs:
            suffix = f"_seed{run.seed}" if all_seeds else ""
            p = out / f"timeseries_{name}{suffix}.csv"
            write_timeseries(run, p)
            written.append(p)
    for fn, fname in ((plot_devices, "devices.png"), (plot_throughput, "throughput.png")):
        p = out / fname
        fn(result, p)
        written.append(p)
    return written
