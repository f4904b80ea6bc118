"""What ``odyssey plan`` shows a person: the candidates table, the chosen layout, how the search went,
and a progress bar while an exhaustive search runs.

Layer ranges are half-open, ``[0,6)`` = layers 0..5, exactly as the JSON's ``"layers": [0, 6]``.
Progress goes to stderr, so stdout stays the table (or the JSON, which never gets a progress bar).
"""
from __future__ import annotations

import sys
from typing import TextIO

from .exhaustive import SearchStatus, describe_count, describe_seconds
from .planner import Decision

WIDE_CONSOLE = 160  # off a terminal (a file, a pipe, a CI log), rich would wrap at 80 columns or $COLUMNS


def terminal_console():
    """The rich console every ``odyssey`` command prints its tables on: the terminal's width, or wide
    off a terminal so that no table cuts names short."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else WIDE_CONSOLE)


def print_decision(decision: Decision, console=None) -> None:
    from rich.table import Table

    console = console or terminal_console()
    table = Table(title=f"Recovery candidates for failed nodes {sorted(decision.failed) or 'none'}")
    for col in ("policy", "step time (s)", "transition (s)", "score (samples/s)", "note"):
        table.add_column(col, no_wrap=col == "policy")
    for c in decision.candidates:
        mark = "[bold green]* " if c is decision.chosen else "  "
        table.add_row(mark + c.label, f"{c.step_time_s:.4g}" if c.feasible else "-",
                      f"{c.transition.total_s:.4g}" if c.feasible else "-",
                      f"{c.score:.4g}" if c.feasible else "-", c.reason)
    console.print(table)
    plan = decision.plan
    if plan is not None:
        layout = Table(title=f"Chosen plan {plan.plan_id} ({decision.policy}{', bubble filling' if plan.fill else ''}"
                             f"{', staggered optimizer' if plan.stagger else ''})",
                       caption="node[first,end): half-open layer ranges, as the JSON's \"layers\"")
        for col in ("pipeline", "micro-batches", "stages: node[layers)"):
            layout.add_column(col)
        for k, p in enumerate(plan.pipelines):
            stages = "  ".join(f"{s.node}{'(dead)' if s.node in plan.failed else ''}{s.layers_text}" for s in p.stages)
            layout.add_row(str(k), str(p.micro_batches), stages)
        console.print(layout)
    est = decision.to_json()["estimates"]
    console.print(f"search {decision.search_time_s * 1e3:.1f} ms; gradient sync {est['sync_rounds']} rounds "
                  f"(lower bound {est['sync_lower_bound']}); {est['transfer_bytes'] / 2**30:.2f} GiB to transfer; "
                  f"next failure expected in {decision.time_to_next_failure_s / 3600:.1f} h")
    if decision.search is not None:
        console.print(search_summary(decision.search))


def search_summary(st: SearchStatus) -> str:
    """One line on the exhaustive search: finished, or cut short (the plan is then the best so far)."""
    done = f"{st.layouts_done:,} of {describe_count(st)} layouts"
    if st.cut_short:
        origin = "" if st.improved_on_heuristic else " (the heuristic's)"
        return (f"[bold yellow]exhaustive search cut short[/] at --time-limit {st.time_limit_s:g} s after {done}: "
                f"the plan is the best found so far{origin}")
    return f"exhaustive search complete: {done} in {describe_seconds(st.elapsed_s)}"


class SearchProgress:
    """The exhaustive search's progress on stderr: its estimated size once, then a tqdm bar."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.bar = None

    def __call__(self, st: SearchStatus) -> None:
        if self.bar is None:
            if st.complete:
                return  # finished while it timed itself: nothing to show
            limit = f"; stops at --time-limit {st.time_limit_s:g} s" if st.time_limit_s is not None else ""
            print(f"exhaustive search: {describe_count(st)} layouts, {st.splits_total:,.0f} layer splits, "
                  f"estimated {describe_seconds(st.estimated_s)} of CPU{limit}", file=self.stream)
            from tqdm import tqdm

            exact = st.layouts_total_exact and st.layouts_total < 1e15
            self.bar = tqdm(total=int(st.layouts_total) if exact else None, unit="layout", desc="exhaustive search",
                            file=self.stream, leave=False, dynamic_ncols=True)
        self.bar.set_postfix_str(f"best step {st.best_step_s:.4g} s", refresh=False)
        self.bar.update(st.layouts_done - self.bar.n)
        if st.complete or st.cut_short:
            self.bar.close()
            self.bar = None
