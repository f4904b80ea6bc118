"""Everything a person looks at: the terminal table, per-policy time-series CSVs and the two plots
of the Odyssey paper (Fig. 7: devices alive over time; Fig. 8: throughput over time).

Plots use matplotlib's Agg backend (no display needed). The time series and plots show the first
seed (all seeds use the same format; ``write_outputs(..., all_seeds=True)`` writes every seed's CSV).
"""
from __future__ import annotations

import csv
from pathlib import Path

from .result import CONTRACT_RATIOS, SimulationResult
from .timeline import PolicyRun

CSV_COLUMNS = ("time_s", "devices_alive", "devices_used", "throughput", "state")


def summary_table(result: SimulationResult):
    """A rich Table: one row per policy, means over seeds with spread, then the contract ratios."""
    from rich.table import Table

    n = len(result.seeds)
    table = Table(title=f"odyssey simulate: {n} seed(s), fault-free {result.fault_free_throughput:.3f} samples/s")
    for col in ("policy", "avg samples/s", "std", "% fault-free", "samples", "downtime s", "reconfigs"):
        table.add_column(col, justify="left" if col == "policy" else "right")
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
    from rich.console import Console

    (console or Console()).print(summary_table(result))


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


def _steps(run: PolicyRun, attr: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for s in run.segments:
        xs += [s.start_s / 3600, s.end_s / 3600]
        ys += [getattr(s, attr)] * 2
    return xs, ys


def plot_devices(result: SimulationResult, path: Path, seed_index: int = 0) -> None:
    """Fig. 7: devices alive in the cluster, and devices each policy keeps busy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    runs = {n: s.runs[seed_index] for n, s in result.policies.items()}
    first = next(iter(runs.values()))
    ax.plot(*_steps(first, "devices_alive"), color="black", lw=2, label="devices alive")
    for name, run in runs.items():
        if name in ("fault-scaled", "ideal"):
            continue
        ax.plot(*_steps(run, "devices_used"), lw=1.2, alpha=0.8, label=f"{name} (in use)")
    ax.set_xlabel("time (h)")
    ax.set_ylabel("devices")
    ax.set_title(f"Devices over time (seed {result.seeds[seed_index]})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_throughput(result: SimulationResult, path: Path, seed_index: int = 0) -> None:
    """Fig. 8: throughput over time per policy (dotted lines: each policy's average)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (name, s) in enumerate(result.policies.items()):
        run = s.runs[seed_index]
        line, = ax.plot(*_steps(run, "throughput"), lw=1.2, label=name)
        ax.axhline(run.avg_throughput, color=line.get_color(), ls=":", lw=1)
    ax.set_xlabel("time (h)")
    ax.set_ylabel("throughput (samples/s)")
    ax.set_title(f"Training throughput over time (seed {result.seeds[seed_index]}; dotted: average)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
