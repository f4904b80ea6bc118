"""The exhaustive layout search (``--search exhaustive``): an oracle that says up front how big it is.

It enumerates every pipeline count, every multiset of pipeline lengths, every batch split and, per
pipeline, every layer split on the Pareto front of (pipeline time, most units on one node). On a
32-node job that is astronomically many layouts, and a search that ran for ten minutes in silence
was how a user found out. So the search first counts its work (``count_layouts``,
``count_layer_splits``), times itself for a fraction of a second, and refuses (``SearchTooLarge``)
when the estimate exceeds the budget, unless a time limit is given; with one, it stops at the limit
and returns the best layout found so far, marked as cut short. It starts from the heuristic's best
layout, so a cut-short result is never worse than the heuristic, and pruning starts at once.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from itertools import product
from typing import Any, Callable, Iterator

import numpy as np

from .errors import PlanningError
from .estimator import estimate_step
from .partition import PipelineModel, _front, compositions, length_multisets
from .plan import ExecutionPlan, layout
from .profile import ModelProfile
from .sharding import optimizer_share

CALIBRATE_S = 0.25  # how long the search runs before it estimates its total time
COUNT_FLOPS = 5e7  # past this, the layout count is computed on fewer micro-batches: a lower bound
REPORT_EVERY_S = 0.1


@dataclass
class SearchStatus:
    """How big the exhaustive search is, how far it got, and whether it finished."""

    layouts_total: float  # (pipeline lengths, batch split) combinations it scores
    layouts_total_exact: bool  # False: a lower bound (the count itself would take too long)
    splits_total: float  # layer splits its Pareto fronts examine
    layouts_done: int = 0
    splits_done: int = 0
    elapsed_s: float = 0.0
    estimated_s: float | None = None  # whole search (CPU seconds), from a short timing of itself
    complete: bool = False
    cut_short: bool = False
    time_limit_s: float | None = None
    best_step_s: float = math.inf
    improved_on_heuristic: bool = False

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("layouts_total", "splits_total", "best_step_s", "estimated_s"):
            value = out[key]
            if value is not None and not math.isfinite(value):
                out[key] = None
        for key in ("layouts_total", "splits_total"):
            if out[key] is not None and out[key] < 2**53:
                out[key] = int(out[key])
        return out


class SearchTooLarge(PlanningError):
    """The estimate exceeds the budget and no time limit was given; carries the numbers."""

    def __init__(self, status: SearchStatus, budget_s: float):
        self.status, self.budget_s = status, budget_s
        super().__init__(f"exhaustive search would score {describe_count(status)} layouts "
                         f"(estimated {describe_seconds(status.estimated_s)} of CPU, over the {budget_s:g} s budget)")


def describe_count(status: SearchStatus) -> str:
    n = status.layouts_total
    if not math.isfinite(n):
        return "astronomically many"
    if not status.layouts_total_exact and n < 1:
        return "too many to count"
    text = f"{n:,.0f}" if n < 1e7 else f"{n:.2g}"
    return text if status.layouts_total_exact else f"at least {text}"


def describe_seconds(s: float | None) -> str:
    if s is None:
        return "unknown"
    if not math.isfinite(s):
        return "forever"
    if s < 120:
        return f"{s:.1f} s"
    if s < 2 * 86400:
        return f"{s / 3600:.1f} h"
    years = s / (365 * 86400)
    return f"{s / 86400:.0f} days" if years < 1 else f"{years:.2g} years"


# -- counting ------------------------------------------------------------------------------------


def _partitions_exact(max_total: int, max_parts: int) -> np.ndarray:
    """P[s, c] = ways to write s as a sum of exactly c positive parts (order ignored)."""
    p = np.zeros((max_total + 1, max_parts + 1))
    p[0, 0] = 1.0
    for s in range(1, max_total + 1):
        for c in range(1, min(s, max_parts) + 1):
            p[s, c] = p[s - 1, c - 1] + p[s - c, c]
    return p


def count_layouts(num_nodes: int, num_micro_batches: int, num_layers: int, floor: int = 1,
                  max_flops: float = COUNT_FLOPS) -> tuple[float, bool]:
    """How many (length multiset, batch split) layouts the search scores, and whether exact.

    A layout is a multiset of (pipeline length, micro-batches) pairs with lengths 1..L summing to the
    nodes and micro-batches summing to the batch; the count is a dynamic programme over lengths, each
    length contributing c pipelines whose batches are a partition into c parts. When that programme
    would be slow, it runs with fewer micro-batches, which gives a lower bound (the count grows with
    the batch)."""
    n, L = num_nodes, num_layers
    rows = sum(n + 1 - c * l for l in range(1, min(L, n) + 1) for c in range(1, n // l + 1))
    cap = max(1, min(num_micro_batches, int(math.sqrt(max_flops / max(rows, 1))) - 1))
    exact = cap == num_micro_batches
    parts = _partitions_exact(cap, n)
    diff = np.arange(cap + 1)[None, :] - np.arange(cap + 1)[:, None]  # T[b, b'] uses P[b' - b]
    valid = diff >= 0
    index = np.where(valid, diff, 0)
    table = np.zeros((n + 1, cap + 1))
    table[0, 0] = 1.0
    with np.errstate(over="ignore", invalid="ignore"):
        for length in range(1, min(L, n) + 1):
            new = table.copy()
            for c in range(1, n // length + 1):
                shift = np.where(valid, parts[index, c], 0.0)
                new[c * length:, :] += table[: n + 1 - c * length, :] @ shift
            table = new
    total = float(table[n, cap])
    if floor >= 2 and n <= L:
        total -= 1.0  # the single pipeline of every node, which the floor excludes
    if floor > 2:
        exact = False
    return (total if math.isfinite(total) else math.inf), exact


def count_layer_splits(num_nodes: int, num_micro_batches: int, num_layers: int, floor: int = 1,
                       shard_copies: int = 0, tied: bool = False) -> float:
    """Layer splits the Pareto fronts examine: every composition of L layers for each (pipeline
    length, micro-batches) pair a layout can contain (an upper estimate: nearly every pair occurs), once per
    share of a sharded optimizer's state the pipeline counts give (one share without sharding; with tied
    embeddings, per pair of a unit's and an end unit's share: ``PipelineModel``)."""
    def pairs(fewest_pipelines: int) -> float:
        spare = fewest_pipelines - 1
        longest = min(num_layers, num_nodes - spare)
        per_batch = sum(math.comb(num_layers - 1, k - 1) for k in range(1, longest + 1))
        return float(per_batch) * max(1, num_micro_batches - spare)

    counts = range(max(floor, 1), max(floor, min(num_nodes, num_micro_batches)) + 1)
    fewest_by_share: dict[tuple[float, float], int] = {}
    for k in counts:
        share = optimizer_share(k, shard_copies)
        fewest_by_share.setdefault((share, optimizer_share(2 * k, shard_copies) if tied else share), k)
    return sum(pairs(k) for k in fewest_by_share.values())


# -- the search ----------------------------------------------------------------------------------


class ExhaustiveSearch:
    """One exhaustive search over ``num_nodes`` placeholder nodes (0..N-1), started from ``seed``."""

    def __init__(self, profile: ModelProfile, model: PipelineModel, num_nodes: int, num_micro_batches: int,
                 floor: int, seed: ExecutionPlan | None = None):
        self.profile, self.model = profile, model
        self.num_nodes, self.num_micro_batches, self.floor = num_nodes, num_micro_batches, floor
        L = profile.num_layers
        total, exact = count_layouts(num_nodes, num_micro_batches, L, floor)
        self.status = SearchStatus(total, exact, count_layer_splits(num_nodes, num_micro_batches, L, floor,
                                                                    profile.optimizer_shard_copies,
                                                                    profile.tied_embeddings))
        self.best_plan = seed
        self.best_t = estimate_step(seed, profile).step_time_s if seed is not None else math.inf
        self.status.best_step_s = self.best_t
        # (stages, micro-batches, model) -> Pareto front; the model differs by pipeline count only when a
        # sharded optimizer's share does (PipelineModel.with_pipelines)
        self.fronts: dict[tuple[int, int, PipelineModel], list[tuple[int, ...]]] = {}

    def run(self, time_limit_s: float | None = None, budget_s: float | None = 60.0,
            on_progress: Callable[[SearchStatus], None] | None = None,
            calibrate_s: float = CALIBRATE_S) -> ExecutionPlan | None:
        """Search until done or ``time_limit_s``; after ``calibrate_s``, estimate the total and raise
        ``SearchTooLarge`` if it exceeds ``budget_s`` while no time limit is set.

        The estimate and its calibration count this thread's CPU time, not the wall clock: the size of a search
        is the problem's, and on a loaded machine the first 0.25 s of wall time can hold almost none of the
        search's own work (a 0.4 s search was once estimated at 99 s and refused). ``time_limit_s`` stays wall
        time: the answer is wanted by then."""
        st = self.status
        st.time_limit_s = time_limit_s
        start = last_report = time.perf_counter()
        cpu_start = last = time.thread_time()
        deadline = start + time_limit_s if time_limit_s is not None else math.inf
        spent = {"split": 0.0, "layout": 0.0}
        for tag in self._work():
            now, cpu = time.perf_counter(), time.thread_time()
            spent["split" if tag == "split" else "layout"] += cpu - last
            last = cpu
            if st.estimated_s is None and cpu - cpu_start >= calibrate_s:
                st.elapsed_s = now - start
                st.estimated_s = self._estimate(spent, cpu - cpu_start)
                if time_limit_s is None and budget_s is not None and st.estimated_s > budget_s:
                    raise SearchTooLarge(st, budget_s)
                if on_progress:
                    on_progress(st)
            if now >= deadline:
                st.cut_short = True
                break
            if on_progress and st.estimated_s is not None and now - last_report >= REPORT_EVERY_S:
                st.elapsed_s = now - start
                on_progress(st)
                last_report = now
        else:
            st.complete = True
        st.elapsed_s = time.perf_counter() - start
        if st.estimated_s is None:
            st.estimated_s = st.elapsed_s
        st.best_step_s = self.best_t
        if on_progress:
            on_progress(st)
        return self.best_plan

    def _estimate(self, spent: dict[str, float], done_s: float) -> float:
        """CPU seconds for the whole search: ``done_s`` so far, plus the time per layer split and per layout seen
        so far times what is left. Rough (pruning makes later layouts cheaper), but the right order of magnitude."""
        st = self.status
        t_split = spent["split"] / st.splits_done if st.splits_done else 1e-5
        t_layout = spent["layout"] / st.layouts_done if st.layouts_done else 10 * t_split
        left = (max(st.splits_total - st.splits_done, 0.0) * t_split
                + max(st.layouts_total - st.layouts_done, 0.0) * t_layout)
        return done_s + left

    def _work(self) -> Iterator[str]:
        """The search itself, yielding after each unit of work ("split", "layout", "estimate") so
        the runner can time it, report progress and stop at a deadline."""
        L, m_total, st = self.profile.num_layers, self.num_micro_batches, self.status
        for dp in range(self.floor, min(self.num_nodes, m_total) + 1):
            for lengths in length_multisets(self.num_nodes, dp, 1, L):
                model = self.model.with_pipelines(dp)
                for batch in batch_splits(lengths, m_total):
                    options = []
                    for length, m in zip(lengths, batch):
                        if (length, m, model) not in self.fronts:
                            yield from self._front(length, m, model)
                        options.append(self.fronts[(length, m, model)])
                    st.layouts_done += 1
                    if not all(options):
                        yield "layout"
                        continue
                    fastest = max(min(self.model.time(s, m) for s in opts) for opts, m in zip(options, batch))
                    if fastest < self.best_t:  # sync and optimizer only add time
                        for splits in product(*options):
                            plan = layout(list(zip(splits, batch)), num_layers=L)
                            t = estimate_step(plan, self.profile).step_time_s
                            if t < self.best_t:
                                self.best_plan, self.best_t = plan, t
                                st.best_step_s, st.improved_on_heuristic = t, True
                            yield "estimate"
                    yield "layout"

    def _front(self, length: int, m: int, model: PipelineModel) -> Iterator[str]:
        """Every memory-feasible split of the layers over ``length`` stages, reduced to its Pareto front
        in (pipeline time, most units on one node): that second coordinate sets the whole plan's
        gradient-sync rounds and optimizer time, so keeping only the fastest split could miss the best."""
        feasible = []
        for split in compositions(self.profile.num_layers, length):
            self.status.splits_done += 1
            if model.fits(split, m):
                feasible.append(split)
            yield "split"
        self.fronts[(length, m, model)] = list(_front(feasible, model, m))


def batch_splits(lengths: tuple[int, ...], total: int) -> Iterator[list[int]]:
    """Every assignment of micro-batches (>=1 each) to pipelines, up to swapping equal-length ones."""
    k = len(lengths)

    def rec(i: int, remaining: int, prev: int | None) -> Iterator[list[int]]:
        if i == k - 1:
            if remaining >= 1 and (prev is None or lengths[i] != lengths[i - 1] or remaining <= prev):
                yield [remaining]
            return
        cap = remaining - (k - 1 - i)
        if prev is not None and lengths[i] == lengths[i - 1]:
            cap = min(cap, prev)
        for m in range(1, cap + 1):
            for rest in rec(i + 1, remaining - m, m):
                yield [m, *rest]

    yield from rec(0, total, None)
