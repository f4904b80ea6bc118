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
COLOURS = {"odyssey": "#d62728", "odyssey-f1": "#ff9896", "odyssey-ignore-slow": "#ff7f0e",
           "odyssey-slow-as-failure": "#8c564b", "oobleck": "#1f77b4", "recycle": "#2ca02c",
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


# -- fail-slow (docs/fail_slow.png) ------------------------------------------------------------------------

SLOW_STYLES = {  # the three ways Odyssey handles a slow node, and the baselines that ignore it
    "odyssey": dict(color=COLOURS["odyssey"], marker="o", ls="-",
                    label="odyssey (Eq. 8: carry on / rebalance / drop)"),
    "odyssey-ignore-slow": dict(color=COLOURS["odyssey-ignore-slow"], marker="s", ls="--", label="odyssey-ignore-slow"),
    "odyssey-slow-as-failure": dict(color=COLOURS["odyssey-slow-as-failure"], marker="^", ls=":",
                                    label="odyssey-slow-as-failure"),
    "recycle": dict(color=COLOURS["recycle"], marker="v", ls="-", label="recycle (does not detect fail-slow)"),
    "oobleck": dict(color=COLOURS["oobleck"], marker="D", ls="-", label="oobleck (does not detect fail-slow)"),
}
_SETTING_LABELS = {"none": "no fail-slow\n(failures only)", "greyhound": "Greyhound",
                   "greyhound-x10": "Greyhound\nrates x10", "greyhound-severe": "Greyhound\nsevere (5-10x)"}


def _levels(run: PolicyRun, min_gap_s: float = 300.0) -> tuple[list[float], list[float]]:
    """The throughput step function with short stops (transitions) left out, so levels can be compared."""
    xs: list[float] = []
    ys: list[float] = []
    for s in run.segments:
        if s.throughput <= 0 and s.duration_s < min_gap_s and ys:
            xs[-1] = s.end_s / 3600
            continue
        if ys and ys[-1] == s.throughput:
            xs[-1] = s.end_s / 3600
            continue
        xs += [s.start_s / 3600, s.end_s / 3600]
        ys += [s.throughput] * 2
    return xs, ys


def plot_fail_slow(results: dict[str, SimulationResult], reference: SimulationResult, shown: str,
                   spans: list[tuple[float, float, int]], path: Path) -> None:
    """docs/fail_slow.png. Left: each policy's average throughput per fail-slow setting (dots: seeds, bar:
    mean), the failures-only run as the reference. Right: one seed of ``shown`` over time, slow periods shaded."""
    plt = _pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 5.2), gridspec_kw=dict(width_ratios=[1.1, 1.0]))
    _fail_slow_averages(ax, results, reference)
    _fail_slow_timeline(bx, results[shown], shown, spans)
    fig.suptitle("Fail-slow: Odyssey's Eq. 8 choice vs ignoring slow nodes vs treating them as failed "
                 "(32 NPUs, Llama-2-7B, PP=4 x DP=8, batch 64)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fail_slow_averages(ax, results: dict[str, SimulationResult], reference: SimulationResult) -> None:
    from matplotlib.lines import Line2D

    groups = ["none"] + list(results)
    names = list(SLOW_STYLES)
    width = 0.8 / len(names)
    ff = reference.fault_free_throughput
    for g, preset in enumerate(groups):
        res = reference if preset == "none" else results[preset]
        for name in (n for n in names if n in res.policies):
            xs = [100 * r.avg_throughput / ff for r in res.policies[name].runs]
            x = g - 0.4 + width * (names.index(name) + 0.5)
            st = SLOW_STYLES[name]
            ax.scatter([x] * len(xs), xs, s=14, color=st["color"], marker=st["marker"], alpha=0.45, lw=0)
            ax.hlines(sum(xs) / len(xs), x - width * 0.45, x + width * 0.45, color=st["color"], lw=2.4)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([_SETTING_LABELS.get(g, g) for g in groups])
    ax.set_ylabel("average throughput (% of fault-free)")
    ax.set_xlabel("fail-slow setting (all with 10% failures per NPU-hour)")
    hours = reference.policies["odyssey"].runs[0].horizon_s / 3600
    ax.set_title(f"Average over {hours:g} h, {len(reference.seeds)} seeds: bar = mean, dots = seeds")
    ax.grid(axis="y", alpha=0.3)
    handles = [Line2D([], [], color=SLOW_STYLES[n]["color"], marker=SLOW_STYLES[n]["marker"], lw=2.4,
                      label=SLOW_STYLES[n]["label"]) for n in names]
    ax.legend(handles=handles, fontsize=8, loc="lower left", frameon=True, framealpha=0.9)


def _fail_slow_timeline(bx, res: SimulationResult, shown: str, spans: list[tuple[float, float, int]]) -> None:
    from matplotlib.patches import Patch

    top = 0.0
    for name, lw in (("odyssey", 3.2), ("odyssey-slow-as-failure", 1.6), ("odyssey-ignore-slow", 1.6)):
        st = SLOW_STYLES[name]  # (drawn thick first, so that identical paths stay visible)
        xs, ys = _levels(res.policies[name].runs[0])
        bx.plot(xs, ys, color=st["color"], lw=lw, ls=st["ls"], label=st["label"], zorder=3)
        top = max(top, max(ys, default=0.0))
    for t0, t1, n in spans:
        bx.axvspan(t0 / 3600, t1 / 3600, color="0.6", alpha=min(0.5, 0.18 * n), lw=0, zorder=1)
    bx.set_ylim(0, top * 1.45)
    bx.set_xlim(0, res.policies["odyssey"].runs[0].horizon_s / 3600)
    bx.set_xlabel("time (h)")
    bx.set_ylabel("throughput (samples/s)")
    bx.set_title(f"One run ({shown}, seed {res.seeds[0]}); stops < 5 min not drawn")
    bx.grid(alpha=0.3)
    h, labels = bx.get_legend_handles_labels()
    h.append(Patch(color="0.6", alpha=0.35, lw=0))
    labels.append("a live node is slow (darker: more)")
    bx.legend(h, labels, fontsize=8, loc="upper right", framealpha=0.9)
