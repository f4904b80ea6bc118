"""How a person reads an ``odyssey train`` report: the tables, why each policy won, and the plot.

The demo is the product's first impression, so everything here explains itself: each decision is
put in Eq. 8's terms with the numbers the planner used, and the plot is drawn on one clock (the
report's ``wall_s``: seconds since the ranks started) with the failures where they happened.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..planning.estimator import score
from ..planning.planner import DEFAULT_MTBF_HOURS, policy_label


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def _kind(entry: dict[str, Any]) -> tuple[str, bool, bool]:
    """A failure's or candidate's kind, bubble filling and staggered optimizer (reports before them name the
    policy only)."""
    return entry.get("kind") or entry["policy"], bool(entry.get("fill")), bool(entry.get("stagger"))


def policy_name(entry: dict[str, Any]) -> str:
    """A failure's or candidate's name, the filled, staggered and normalised reroutes told apart."""
    return policy_label(*_kind(entry))


def explain_failure(failure: dict[str, Any], global_batch: int) -> str:
    """One line: why the chosen policy's Eq. 8 score beat the runner-up's, the time to the next failure
    it assumed, whether the planner's default MTBF would have changed it, and where the decision came
    from (the precomputed plan cache answers in microseconds)."""
    ranks = ", ".join(str(r) for r in failure["ranks"])
    head = f"step {failure['step']}, rank {ranks} ({failure.get('phase') or 'unknown phase'})"
    feasible = sorted((c for c in failure.get("candidates", []) if c["feasible"]), key=lambda c: -c["score"])
    chosen = next((c for c in feasible if _kind(c) == _kind(failure)), None)
    if chosen is None:
        return f"{head}: {failure['policy'] or 'no policy'} ({failure.get('reason', '')})"
    others = [c for c in feasible if c is not chosen]
    line = f"{head}: [bold]{policy_name(chosen)}[/], Eq. 8 score {chosen['score']:.4g}"
    if others:
        line += " vs " + ", ".join(f"{policy_name(c)} {c['score']:.4g}" for c in others)
    t_next = failure.get("time_to_next_failure_s") or 0.0
    mtbf = failure.get("mtbf_hours") or 0.0
    live = round(mtbf * 3600 / t_next) if t_next else 0
    if others:
        rival = others[0]
        speedup = rival["step_time_s"] / chosen["step_time_s"] - 1
        extra = rival["transition_time_s"] - chosen["transition_time_s"]
        if speedup >= 0 and extra >= 0:
            line += f": faster steps and a shorter transition than {policy_name(rival)}"
        elif speedup < 0 <= extra:
            line += (f": {policy_name(rival)}'s steps would be {-speedup / (1 + speedup):.0%} faster, but its "
                     f"{rival['transition_time_s']:.2g} s transition (vs {chosen['transition_time_s']:.2g} s) "
                     f"costs more")
        else:
            line += (f": its steps are {speedup:.0%} faster than {policy_name(rival)}'s, which outweighs its "
                     f"{-extra:.2g} s longer transition")
    if t_next:
        line += f" in the {_duration(t_next)} to the next expected failure (MTBF {mtbf:.3g} h / {live} devices"
        if mtbf < DEFAULT_MTBF_HOURS and others:
            default_t = DEFAULT_MTBF_HOURS * 3600 / max(live, 1)
            best = max(feasible, key=lambda c: (score(global_batch, c["step_time_s"], c["transition_time_s"],
                                                      default_t, c.get("restart_risk_s", 0.0)), -c["step_time_s"]))
            if best is not chosen:
                line += f"; at {DEFAULT_MTBF_HOURS:,.0f} h {policy_name(best)} would win"
        line += ")"
    source = "from the plan cache" if failure.get("cached") else "planned on demand"
    return line + f"; {source} in {failure['decision_s'] * 1e3:.1f} ms"


def mtbf_note(report: dict[str, Any]) -> str | None:
    """Why the demo assumes failures every few seconds: with a fleet's MTBF no transition ever costs
    anything measurable, so the fastest steps would always win and the choice would show nothing."""
    mtbf = next((f.get("mtbf_hours") for f in report["failures"] if f.get("mtbf_hours")), None)
    if not mtbf or mtbf >= DEFAULT_MTBF_HOURS:
        return None
    return (f"This run assumes a per-device MTBF of {mtbf:.3g} h ({_duration(mtbf * 3600)}), not a fleet's "
            f"{DEFAULT_MTBF_HOURS:,.0f} h, so that a transition's cost weighs against a {len(report['steps'])}-step "
            f"run as a real one weighs against hours of training (--mtbf-hours sets it).")


SUPERSEDED_NOTE = ("*: cut short: another recovery began before this one's first step (a failure, a drop or a "
                   "takeover meanwhile); its time runs to that one's start.")
CACHE_NOTE = ("'cache': the plan cache had planned every single-node failure of the layout in the background "
              "before it happened.")


def print_summary(console, report: dict[str, Any], global_batch: int, wall_s: float) -> None:
    from rich.table import Table

    table = Table(title="Failures and recoveries")
    for col in ("step", "ranks", "phase", "policy", "detection (s)", "decision (ms)", "transfer (s)", "recovery (s)",
                "candidates (step s / transition s / score)"):
        table.add_column(col)
    for f in report["failures"]:
        cands = "; ".join(f"{policy_name(c)}: {_num(c['step_time_s'])}/{_num(c['transition_time_s'])}/{c['score']:.0f}"
                          for c in f["candidates"])
        decision = f"{f['decision_s'] * 1e3:.1f}" + (" (cache)" if f.get("cached") else "")
        table.add_row(str(f["step"]), str(f["ranks"]), f["phase"], f"[bold]{policy_name(f)}", f"{f['detection_s']:.3f}",
                      decision, f"{f['transfer_s']:.3f}", f"{f['recovery_s']:.2f}" + ("*" if f.get("superseded_by")
                                                                             else ""), cands)
    console.print(table)
    if any(f.get("superseded_by") for f in report["failures"]):
        console.print("  " + SUPERSEDED_NOTE)
    for f in report["failures"]:
        console.print("  " + explain_failure(f, global_batch))
    note = mtbf_note(report)
    if note:
        console.print("  " + note)
    if any(f.get("cached") for f in report["failures"]):
        console.print("  " + CACHE_NOTE)
    _print_diagnoses_and_joins(console, report)
    steps = Table(title="Steps")
    for col in ("step", "devices", "policy", "loss", "fault-free loss", "time (s)"):
        steps.add_column(col)
    ref = report.get("reference_losses")
    for s in report["steps"]:
        steps.add_row(str(s["step"]), str(s["alive"]), s["policy"], f"{s['loss']:.6f}",
                      f"{ref[s['step']]:.6f}" if ref else "-",
                      f"{s['time_s']:.3f}" + (" (start-up)" if s["step"] == report["steps"][0]["step"] else ""))
    console.print(steps)
    worst = report.get("max_param_diff_vs_fault_free")
    if worst is not None:
        console.print(f"final parameters vs fault-free training: max |diff| = {worst:.2e} "
                      f"({'identical within 1e-5' if worst < 1e-5 else 'DIFFERENT'}); wall time {wall_s:.0f} s")


def _options(entry: dict[str, Any]) -> str:
    """Every option the planner weighed, as ``action: step s / transition s / Eq. 8 score``."""
    return "; ".join(f"{o['action']}: {_num(o['step_time_s'])}/{_num(o['transition_time_s'])}/{o['score']:.0f}"
                     for o in entry.get("options", []) if o.get("feasible"))


def _print_diagnoses_and_joins(console, report: dict[str, Any]) -> None:
    from rich.table import Table

    if report.get("diagnoses"):
        table = Table(title="Diagnoses (slow, comm-slow, hang, comm-hang)")
        for col in ("step", "ranks", "kind", "factor", "named after (s)", "action", "options (step s / transition s "
                    "/ score)"):
            table.add_column(col)
        for d in report["diagnoses"]:
            table.add_row(str(d["step"]), str(d["ranks"]), d["kind"], f"{d['factor']:.2f}" if d["factor"] != 1 else "-",
                          _num(d.get("detection_s")), f"[bold]{d['action']}", _options(d) or "-")
        console.print(table)
        for d in report["diagnoses"]:
            console.print(f"  step {d['step']}, ranks {d['ranks']}: {d['evidence']}"
                          + (f"; {d['action']}: {d['reason']}" if d.get("reason") else ""))
    if report.get("joins"):
        table = Table(title="Nodes that came back")
        for col in ("step", "ranks", "decision", "transfer (s)", "recovery (s)", "options (step s / transition s / "
                    "score)"):
            table.add_column(col)
        for j in report["joins"]:
            table.add_row(str(j["step"]), str(j["ranks"]), f"[bold]{j['policy']}", _num(j.get("transfer_s")),
                          _num(j.get("recovery_s")), _options(j))
        console.print(table)
        for j in report["joins"]:
            console.print(f"  ranks {j['ranks']} came back: {j['policy']} ({j['reason']})")


def _num(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.3g}"


def run_description(report: dict[str, Any]) -> tuple[str, str | None]:
    """The plot's subtitle from the run itself, and, when ranks time-share CPU cores, why throughput
    can rise after a rank dies."""
    cfg = report.get("config", {})
    nproc, pp = cfg.get("nproc", 0), cfg.get("pp", 1)
    kinds = sorted({d.split(":")[0].split()[0] for d in report.get("devices", {}).values()}) or ["cpu"]
    cores = report.get("host", {}).get("cpu_cores")
    name = cfg.get("extra", {}).get("device", {}).get("name")
    if kinds == ["cpu"] and cores:
        where = f"{cores} CPU core{'s' if cores != 1 else ''}"
    else:
        where = (name or ", ".join(kinds)) + (" shared by every rank" if cfg.get("shared_device") else "")
    title = (f"{nproc} ranks (PP={pp} x DP={nproc // max(pp * cfg.get('tp', 1), 1)}), "
             f"{cfg.get('layers', '?')} layers, global batch {cfg.get('global_batch', '?')}, on {where}")
    note = None
    if kinds == ["cpu"] and cores and nproc > cores:
        note = (f"{nproc} ranks time-share {cores} CPU cores: after a rank dies, each survivor gets more CPU, so "
                "throughput can rise; with one device per rank it falls (the survivors do the dead rank's work)")
    return title, note


def failure_label(f: dict[str, Any]) -> str:
    ranks = ", ".join(str(r) for r in f["ranks"])
    what = "dropped (slow)" if f.get("dropped") else "fails"
    return f"rank {ranks} {what} (step {f['step']}) -> {policy_name(f) or 'stop'}"


def _events(report: dict[str, Any]) -> list[tuple[float, str, int]]:
    """Diagnoses and joins on the report's clock: (wall s, label, change in live devices)."""
    out = []
    for d in report.get("diagnoses", []):
        if d.get("wall_s") is not None and d["kind"] in ("slow", "comm-slow"):
            factor = f" x{d['factor']:.1f}" if d["kind"] == "slow" else ""
            out.append((d["wall_s"], f"rank {', '.join(map(str, d['ranks']))} {d['kind']}{factor} (step {d['step']}) "
                                     f"-> {d['action']}", 0))
    for j in report.get("joins", []):
        if j.get("wall_s") is not None:
            used = j["policy"] != "standby"
            out.append((j["wall_s"], f"rank {', '.join(map(str, j['ranks']))} back (step {j['step']}) -> {j['policy']}",
                        len(j["ranks"]) if used else 0))
    return sorted(out)


def plot_report(report: dict[str, Any], path: str | Path, keep: bool = False):
    """Throughput and live devices on the report's clock, loss against the fault-free run by step;
    each failure is drawn where it happened, with its recovery shaded until training resumed.
    Returns the figure when ``keep`` (tests read its lines), else closes it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = report["steps"]
    cfg = report.get("config", {})
    batch = cfg.get("global_batch", 1)
    nproc = cfg.get("nproc", steps[0]["alive"] if steps else 0)
    fig, axes = plt.subplots(1, 3, figsize=(16, 6))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"][1:]

    # Throughput between commits, over two steps (step 0 is left out: it includes start-up). Two, not one: in a
    # staggered plan the ranks run a step ahead of the commits, so a commit the agent holds back (a returning
    # rank's request) is followed by one at once, and one interval alone would spike.
    ax = axes[0]
    xs, ys = [], []
    for k in range(1, len(steps)):
        first = steps[max(0, k - 2)]
        rate = batch * (k - max(0, k - 2)) / max(steps[k]["wall_s"] - first["wall_s"], 1e-9)
        xs += [steps[k - 1]["wall_s"], steps[k]["wall_s"]]
        ys += [rate, rate]
    ax.plot(xs, ys, color="tab:blue", label="samples/s between commits (over 2 steps)")
    ax.set(xlabel="wall time since the ranks started (s)", ylabel="samples / s", title="Throughput")
    ax.set_ylim(bottom=0)
    if steps:
        ax.set_xlim(left=0)
        ax.axvspan(0, steps[0]["wall_s"], color="0.92", label=f"start-up + step {steps[0]['step']}")

    # Devices alive: a step down when each failure happened.
    ax = axes[1]
    alive, xs, ys = nproc, [0.0], [nproc]
    changes = [(f["wall_s"], -len(f["ranks"])) for f in report["failures"] if f.get("wall_s") is not None]
    changes += [(t, n) for t, _, n in _events(report) if n]
    for t, n in sorted(changes):
        xs += [t, t]
        ys += [alive, alive + n]
        alive += n
    end = steps[-1]["wall_s"] if steps else 0.0
    xs.append(end)
    ys.append(alive)
    ax.plot(xs, ys, color="tab:red")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, nproc + 0.5)
    ax.set(xlabel="wall time since the ranks started (s)", ylabel="devices", title="Devices alive")
    ax.set_xlim(left=0)

    for f, colour in zip(report["failures"], colours):
        if f.get("wall_s") is None:
            continue
        for k, ax in enumerate(axes[:2]):
            ax.axvline(f["wall_s"], ls="--", color=colour, label=failure_label(f) if k == 0 else None)
            ax.axvspan(f["wall_s"], f["wall_s"] + f["recovery_s"], color=colour, alpha=0.15,
                       label=f"recovery ({f['recovery_s']:.2f} s)" if k == 0 else None)
    for (t, label, _), marker in zip(_events(report), ("v", "^", "s", "D", "P", "X")):
        for k, ax in enumerate(axes[:2]):
            ax.axvline(t, ls=":", color="0.3", lw=1.2)
            ax.plot([t], [ax.get_ylim()[1] * 0.97 if k else 0], marker=marker, color="0.3", ms=8, ls="none",
                    label=label if k == 0 else None, clip_on=False)
    # below the time plots: failures, recoveries, diagnoses and joins do not hide the curves
    axes[0].legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.0, -0.14), ncol=3)

    ax = axes[2]
    ax.plot([s["step"] for s in steps], [s["loss"] for s in steps], "o-", label="with failures")
    ref = report.get("reference_losses")
    if ref:
        ax.plot(range(len(ref)), ref, "x--", label="fault-free")
    for f, colour in zip(report["failures"], colours):
        ax.axvline(f["step"] - 0.5, ls="--", color=colour, label=failure_label(f))
    worst = report.get("max_param_diff_vs_fault_free")
    title = "Loss vs the fault-free run"
    if worst is not None:
        title += f"\nfinal parameters differ by at most {worst:.1e}"
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=7)

    subtitle, note = run_description(report)
    fig.suptitle(subtitle)
    if note:
        fig.text(0.5, 0.01, note, ha="center", fontsize=9, style="italic")
    fig.subplots_adjust(left=0.05, right=0.99, top=0.86, bottom=0.36 if note else 0.32, wspace=0.22)
    fig.savefig(path, dpi=100)
    if keep:
        return fig
    plt.close(fig)
    return None
