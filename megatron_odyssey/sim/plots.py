"""The Odyssey paper's two simulation figures (Fig. 7: devices over time; Fig. 8: throughput over time).

Odyssey is the subject, so in the throughput figure it is drawn last, thick and in a colour no
baseline uses: drawn first it disappeared under the baselines wherever their step functions
coincided (its drops to zero during transitions are thin, so a 10 s transition does not read as an
outage). Device counts coincide most of the time, so there Odyssey is a wide translucent band under
the thin baselines: a baseline that uses the same devices shows as a line inside the band. Reference curves
(fault-scaled, ideal) are grey and dashed, so they read as references rather than competitors. The
legend sits outside the axes, where it hides no data. matplotlib's Agg backend: no display needed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .result import SimulationResult
from .timeline import PolicyRun

ODYSSEY = "odyssey"
# fixed colours, so a policy looks the same in both figures and in every run
COLOURS = {"odyssey": "#d62728", "odyssey-f1": "#ff9896", "oobleck": "#1f77b4", "recycle": "#2ca02c",
           "recycle-nofill": "#98df8a", "checkpoint": "#9467bd", "fault-scaled": "#7f7f7f", "ideal": "#bcbd22"}
REFERENCES = ("fault-scaled", "ideal")


def style(name: str) -> dict[str, Any]:
    """Line style of a policy: Odyssey on top and thick, references dashed grey, baselines thin."""
    if name == ODYSSEY:
        return dict(color=COLOURS[name], lw=2.6, zorder=10, alpha=1.0)
    if name in REFERENCES:
        return dict(color=COLOURS[name], lw=1.3, ls="--", zorder=3, alpha=0.9)
    return dict(color=COLOURS.get(name), lw=1.3, zorder=4, alpha=0.85)


def drawing_order(names: list[str]) -> list[str]:
    """References first, baselines next, Odyssey last (on top)."""
    return sorted(names, key=lambda n: (n == ODYSSEY, n not in REFERENCES))


def legend_order(names: list[str]) -> list[str]:
    """Odyssey first in the legend, then the rest as the user listed them."""
    return sorted(names, key=lambda n: n != ODYSSEY)


def _steps(run: PolicyRun, attr: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for s in run.segments:
        xs += [s.start_s / 3600, s.end_s / 3600]
        ys += [getattr(s, attr)] * 2
    return xs, ys


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _finish(fig, ax, handles: dict[str, Any], order: list[str], path: Path) -> None:
    ax.grid(alpha=0.3)
    ax.legend([handles[n] for n in order if n in handles], [n for n in order if n in handles], fontsize=8,
              loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_devices(result: SimulationResult, path: Path, seed_index: int = 0) -> None:
    """Fig. 7: devices alive in the cluster (shaded), and the devices each policy keeps busy."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(9.5, 4.5))
    runs = {n: s.runs[seed_index] for n, s in result.policies.items() if n not in REFERENCES}
    first = next(iter(result.policies.values())).runs[seed_index]
    xs, ys = _steps(first, "devices_alive")
    handles = {"devices alive": ax.fill_between(xs, ys, color="0.85", zorder=1, lw=0)}
    baselines = [n for n in runs if n != ODYSSEY]
    for name in drawing_order(list(runs)):
        st = style(name)
        if name == ODYSSEY:  # policies often use the same devices: a wide band under the thin baselines keeps all visible
            st.update(lw=6.0, alpha=0.4, zorder=2)
        else:  # each later baseline thinner, so one drawn over an identical one leaves it showing
            st.update(lw=max(0.8, 2.4 - 0.7 * baselines.index(name)))
        handles[f"{name} (in use)"], = ax.plot(*_steps(runs[name], "devices_used"), **st)
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("time (h)")
    ax.set_ylabel("devices")
    ax.set_title(f"Devices over time (seed {result.seeds[seed_index]}; nested lines use the same devices)")
    order = ["devices alive"] + [f"{n} (in use)" for n in legend_order(list(runs))]
    _finish(fig, ax, handles, order, path)
    plt.close(fig)


def plot_throughput(result: SimulationResult, path: Path, seed_index: int = 0) -> None:
    """Fig. 8: throughput over time per policy; dotted lines are each policy's average."""
    fig = throughput_figure(result, path, seed_index)
    _pyplot().close(fig)


def throughput_figure(result: SimulationResult, path: Path, seed_index: int = 0):
    """Fig. 8, saved to ``path`` and returned open (the tests look at what is drawn on top)."""
    plt = _pyplot()
    from matplotlib.lines import Line2D

    fig, ax = plt.subplots(figsize=(9.5, 4.5))
    names = list(result.policies)
    handles = {}
    for name in drawing_order(names):
        run = result.policies[name].runs[seed_index]
        st = style(name)
        handles[name], = ax.plot(*_steps(run, "throughput"), **st)
        if name == ODYSSEY:  # thick levels, thin drops: a 10 s transition should not look like an outage
            handles[name].set(linewidth=0.8, alpha=0.5, zorder=st["zorder"] - 0.5)
            ax.hlines([s.throughput for s in run.segments], [s.start_s / 3600 for s in run.segments],
                      [s.end_s / 3600 for s in run.segments], color=st["color"], lw=st["lw"], zorder=st["zorder"])
            handles[name] = Line2D([], [], color=st["color"], lw=st["lw"])
        ax.axhline(run.avg_throughput, color=st["color"], ls=":", lw=1.6 if name == ODYSSEY else 1.0,
                   zorder=st["zorder"] - 1)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("time (h)")
    ax.set_ylabel("throughput (samples/s)")
    ax.set_title(f"Training throughput over time (seed {result.seeds[seed_index]}; dotted: each policy's average)")
    _finish(fig, ax, handles, legend_order(names), path)
    return fig
