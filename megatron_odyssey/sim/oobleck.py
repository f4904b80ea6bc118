"""Oobleck's pipeline-template machinery (Jang et al., SOSP '23), as pure Python.

The cluster simulator uses this module to model Oobleck as one of the fault-tolerance
policies it compares.  It reproduces the planning/execution split of the paper:

* §4.1.1  template node counts: consecutive integers ``n0 .. N - f*n0``;
* §4.2.1  enumerate every combination of templates that uses all nodes with >= f+1 pipelines
          (coin-change DP, Eq. 5);
* §4.2.2  batch distribution across heterogeneous pipelines, pick the plan of highest throughput;
* §5.1    reinstantiation after failures: simple reinstantiation, borrowing nodes, merging;
* §5.2    batch redistribution after reinstantiation;
* §3.4/§5 Oobleck stops when fewer than ``(f+1)*n0`` nodes remain.

What is *not* modelled: the GPU-stage mapping DP of §4.1.2.  The simulator supplies
``pipeline_time(num_nodes, num_microbatches)`` (its estimator stands in for that DP), and for
copy-cost accounting each node of a template is assumed to hold a contiguous, evenly sized
slice of the model's layers (see :func:`node_layer_ranges`).

Numbers quoted in docstrings as "paper" refer to /work/shared/papers/oobleck.txt.
No torch import: this runs inside the CPU-only simulator.
"""

from __future__ import annotations

import heapq
import math
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

__all__ = [
    "PipelineTimeFn",
    "OobleckConfig",
    "PipelineTemplate",
    "PipelineInstance",
    "Instantiation",
    "BatchDistribution",
    "generate_templates",
    "template_node_counts",
    "enumerate_plans",
    "enumerate_instantiations",
    "representable_node_counts",
    "distribute_batch",
    "build_instantiation",
    "instantiate",
    "reinstantiate",
    "add_nodes",
    "node_layer_ranges",
    "layers_to_copy",
    "layers_to_copy_per_node",
    "surviving_layer_replicas",
    "is_recoverable",
]

#: ``pipeline_time(num_nodes, num_microbatches) -> seconds`` for one iteration of one pipeline
#: instantiated from the template with ``num_nodes`` nodes.  Must be finite, >= 0 and
#: non-decreasing in ``num_microbatches`` (true of any 1F1B cost model); the exact optimisers
#: below rely on that monotonicity.
PipelineTimeFn = Callable[[int, int], float]


# --------------------------------------------------------------------------------------------
# Configuration and result types
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class OobleckConfig:
    """Inputs of Oobleck's planner (§3.4: N nodes, threshold f, batch info).

    ``min_nodes_per_pipeline`` (n0) is derived by the caller from memory (§4.1.1 "smallest
    possible n0"): the fewest nodes whose aggregate memory holds one model replica.
    Identity-hashed (``eq=False``) so per-config caches can key on it.
    """

    num_nodes: int
    """N: nodes the job starts with; templates are generated for it once (§3.3)."""
    fault_tolerance: int
    """f: simultaneous (pipeline) failures to tolerate; >= f+1 pipelines are kept (§3.2)."""
    min_nodes_per_pipeline: int
    """n0: smallest template (§4.1.1)."""
    global_num_microbatches: int
    """Global batch in micro-batches (B/b of §4.2.2); constant across reconfigurations (§5.2)."""
    pipeline_time: PipelineTimeFn
    """Iteration time of one pipeline of ``n`` nodes processing ``m`` micro-batches."""

    def __post_init__(self) -> None:
        if self.min_nodes_per_pipeline < 1:
            raise ValueError("min_nodes_per_pipeline (n0) must be >= 1")
        if self.fault_tolerance < 0:
            raise ValueError("fault_tolerance (f) must be >= 0")
        if self.num_nodes < self.min_feasible_nodes:
            raise ValueError(
                f"N={self.num_nodes} < (f+1)*n0={self.min_feasible_nodes}: Oobleck cannot start "
                "(it needs f+1 pipeline replicas, §3.4)"
            )
        if self.global_num_microbatches < self.fault_tolerance + 1:
            raise ValueError("global batch must give every one of >= f+1 pipelines a micro-batch")

    # Paper notation.
    @property
    def N(self) -> int:  # noqa: N802 - paper notation
        return self.num_nodes

    @property
    def f(self) -> int:
        return self.fault_tolerance

    @property
    def n0(self) -> int:
        return self.min_nodes_per_pipeline

    @property
    def max_template_nodes(self) -> int:
        """n_{p-1}^max = N - f*n0 (§4.1.1): f pipelines of n0 nodes plus one taking the rest."""
        return self.num_nodes - self.fault_tolerance * self.min_nodes_per_pipeline

    @property
    def min_feasible_nodes(self) -> int:
        """(f+1)*n0: below this Oobleck cannot keep f+1 replicas and stops (§3.4, §4.1.1, §5)."""
        return (self.fault_tolerance + 1) * self.min_nodes_per_pipeline


@dataclass(frozen=True)
class PipelineTemplate:
    """A template is fixed by its node count here; its stage mapping (§4.1.2) is abstracted
    into ``pipeline_time`` and an even contiguous layer split (:func:`node_layer_ranges`)."""

    num_nodes: int

    def layer_ranges(self, num_layers: int) -> tuple[range, ...]:
        """Layers held by each node position of this template (stage order)."""
        return node_layer_ranges(num_layers, self.num_nodes)


@dataclass(frozen=True)
class PipelineInstance:
    """One instantiated pipeline: which nodes (in stage order) and its micro-batch share."""

    nodes: tuple[int, ...]
    num_microbatches: int
    iteration_time: float

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def template(self) -> PipelineTemplate:
        return PipelineTemplate(len(self.nodes))


@dataclass(frozen=True)
class Instantiation:
    """A set of heterogeneous pipeline replicas plus their batch distribution (§4.2)."""

    pipelines: tuple[PipelineInstance, ...]
    iteration_time: float
    """max over pipelines: the global batch completes when the slowest pipeline does (§4.2.2)."""
    global_num_microbatches: int
    idle_nodes: tuple[int, ...] = ()
    """Only non-empty when nodes were added beyond what the template set can cover (counts above
    the initial N are not guaranteed representable; §4.1.1 only covers (f+1)*n0..N)."""

    @property
    def num_pipelines(self) -> int:
        return len(self.pipelines)

    @property
    def num_nodes(self) -> int:
        """Nodes doing work (idle nodes excluded)."""
        return sum(p.num_nodes for p in self.pipelines)

    @property
    def node_counts(self) -> tuple[int, ...]:
        return tuple(p.num_nodes for p in self.pipelines)

    @property
    def microbatches(self) -> tuple[int, ...]:
        return tuple(p.num_microbatches for p in self.pipelines)

    @property
    def template_counts(self) -> dict[int, int]:
        """x_i of §4.2.1, keyed by template node count."""
        out: dict[int, int] = {}
        for p in self.pipelines:
            out[p.num_nodes] = out.get(p.num_nodes, 0) + 1
        return dict(sorted(out.items()))

    @property
    def throughput(self) -> float:
        """Micro-batches per unit time (global batch / iteration time)."""
        if self.iteration_time <= 0:
            return math.inf
        return self.global_num_microbatches / self.iteration_time

    @property
    def active_nodes(self) -> tuple[int, ...]:
        return tuple(u for p in self.pipelines for u in p.nodes)

    @property
    def all_nodes(self) -> tuple[int, ...]:
        return self.active_nodes + self.idle_nodes


@dataclass(frozen=True)
class BatchDistribution:
    """Result of §4.2.2 for a fixed list of pipelines."""

    num_microbatches: tuple[int, ...]
    iteration_time: float


# --------------------------------------------------------------------------------------------
# §4.1.1 templates and representability
# --------------------------------------------------------------------------------------------


def template_node_counts(cfg: OobleckConfig) -> list[int]:
    """n_i = n0, n0+1, ..., N - f*n0 (§4.1.1).

    Consecutive integers (condition 2 of §4.1.1) starting at the smallest n0, with the largest
    p: p = N - (f+1)*n0 + 1, the length of the range n0..n_{p-1}^max with n_{p-1}^max = N - f*n0.
    """
    return list(range(cfg.n0, cfg.max_template_nodes + 1))


def generate_templates(cfg: OobleckConfig) -> list[PipelineTemplate]:
    """Templates for node counts n0..N-f*n0 (§4.1.1); fixed for the whole job (§3.3)."""
    return [PipelineTemplate(n) for n in template_node_counts(cfg)]


def _reach_bitsets(sizes: Sequence[int], num_nodes: int) -> list[int]:
    """reach[i] bit r set <=> r is a non-negative combination of sizes[:i+1] (coin change)."""
    mask = (1 << (num_nodes + 1)) - 1
    out: list[int] = []
    reach = 1
    for s in sizes:
        prev = -1
        while prev != reach:  # unbounded coin: close under "+ s"
            prev = reach
            reach = (reach | (reach << s)) & mask
        out.append(reach)
    return out


def enumerate_plans(
    template_sizes: Sequence[int],
    num_nodes: int,
    min_pipelines: int = 1,
    max_pipelines: int | None = None,
) -> Iterator[tuple[int, ...]]:
    """Yield every X = (x_0..x_{p-1}) with sum x_i n_i = num_nodes (Requirement 1, §4.2.1)
    and min_pipelines <= sum x_i <= max_pipelines (Requirement 2 uses min = f+1).

    Same set as the coin-change DP of Eq. 5 followed by the f+1 filter, produced depth-first
    with pruning so that only the feasible plans are ever materialised.
    """
    sizes = list(template_sizes)
    if any(s <= 0 for s in sizes) or len(set(sizes)) != len(sizes):
        raise ValueError("template sizes must be distinct positive integers")
    if num_nodes < 0 or not sizes:
        return
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    srt = [sizes[i] for i in order]
    reach = _reach_bitsets(srt, num_nodes)
    max_p = math.inf if max_pipelines is None else max_pipelines
    counts = [0] * len(srt)

    def emit() -> tuple[int, ...]:
        x = [0] * len(srt)
        for k, idx in enumerate(order):
            x[idx] = counts[k]
        return tuple(x)

    def rec(i: int, rem: int, used: int) -> Iterator[tuple[int, ...]]:
        # Cover `rem` with templates srt[:i+1]; recursion depth = number of distinct templates
        # used (<= sqrt(2*num_nodes)), not the number of templates.
        if rem == 0:
            if used >= min_pipelines:
                yield emit()
            return
        if i < 0 or not (reach[i] >> rem) & 1:
            return
        if used + rem // srt[0] < min_pipelines:  # even all-smallest cannot reach f+1
            return
        for j in range(i, -1, -1):
            if used + -(-rem // srt[j]) > max_p:  # even all-largest-allowed needs too many
                return
            for c in range(rem // srt[j], 0, -1):
                rest = rem - c * srt[j]
                if rest and (j == 0 or not (reach[j - 1] >> rest) & 1):
                    continue
                counts[j] = c
                yield from rec(j - 1, rest, used + c)
                counts[j] = 0

    if num_nodes == 0:
        if min_pipelines <= 0:
            yield tuple([0] * len(sizes))
        return
    yield from rec(len(srt) - 1, num_nodes, 0)


def enumerate_instantiations(cfg: OobleckConfig, num_nodes: int) -> Iterator[dict[int, int]]:
    """All feasible template-count combinations for ``num_nodes`` (§4.2.1), as
    {template nodes: count}; also requires <= B pipelines so each gets a micro-batch."""
    sizes = template_node_counts(cfg)
    for x in enumerate_plans(sizes, num_nodes, cfg.f + 1, cfg.global_num_microbatches):
        yield {n: c for n, c in zip(sizes, x) if c}


def representable_node_counts(cfg: OobleckConfig, max_nodes: int | None = None) -> set[int]:
    """Node counts M <= max_nodes (default N) that some combination of templates with
    >= f+1 pipelines uses exactly (§4.1.1).

    The paper's claim is that this contains every M in [(f+1)*n0, N].  (Indeed f+1 pipelines
    alone suffice: f of n0 nodes and one of M - f*n0 <= N - f*n0 nodes.)  Above N gaps are
    possible when p < n0, e.g. N=8, f=1, n0=4 has only the 4-node template.
    """
    upper = cfg.num_nodes if max_nodes is None else max_nodes
    if upper < 0:
        return set()
    sizes = template_node_counts(cfg)
    need = cfg.f + 1
    mask = (1 << (upper + 1)) - 1
    # layer[k] = bitset of totals reachable with exactly k pipelines (k < need), layer[need] = >= need.
    layer = [0] * (need + 1)
    layer[0] = 1
    for k in range(need):
        nxt = 0
        for s in sizes:
            nxt |= layer[k] << s
        layer[k + 1] = nxt & mask
    acc = layer[need]
    prev = -1
    while prev != acc:
        prev = acc
        for s in sizes:
            acc = (acc | (acc << s)) & mask
    return {m for m in range(upper + 1) if (acc >> m) & 1}


# --------------------------------------------------------------------------------------------
# Per-config planner with caches (pipeline_time may be an expensive estimator).
# --------------------------------------------------------------------------------------------


class _Planner:
    """Caches pipeline_time values and instantiation results for one config."""

    def __init__(self, cfg: OobleckConfig) -> None:
        self.cfg = cfg
        self.B = cfg.global_num_microbatches
        self.sizes = template_node_counts(cfg)
        self._times: dict[tuple[int, int], float] = {}
        self._plans: dict[tuple[int, str], tuple[tuple[int, ...], float]] = {}

    # -- pipeline time -----------------------------------------------------------------------
    def time(self, n: int, m: int) -> float:
        key = (n, m)
        t = self._times.get(key)
        if t is None:
            t = float(self.cfg.pipeline_time(n, m))
            if not math.isfinite(t) or t < 0:
                raise ValueError(f"pipeline_time({n}, {m}) = {t}; must be finite and >= 0")
            self._times[key] = t
        return t

    def cap(self, n: int, t_limit: float) -> int:
        """Most micro-batches (<= B) an n-node pipeline finishes within t_limit (monotone search)."""
        if t_limit == -math.inf:
            return 0
        lo, hi = 0, self.B  # invariant: time(n, lo) <= T (lo=0 trivially), answer in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.time(n, mid) <= t_limit:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _next_candidate(self, sizes: Iterable[int], t_limit: float) -> float:
        best = math.inf
        for n in sizes:
            k = self.cap(n, t_limit)
            if k < self.B:
                best = min(best, self.time(n, k + 1))
        return best

    def _prev_candidate(self, sizes: Iterable[int], t_limit: float) -> float:
        best = -math.inf
        for n in sizes:
            k = self.cap(n, t_limit)
            if k >= 1:
                best = max(best, self.time(n, k))
        return best

    def min_feasible_time(
        self, sizes: Sequence[int], feasible: Callable[[float], bool]
    ) -> float | None:
        """Smallest T among the values pipeline_time(n, m) (n in sizes, 1<=m<=B) with feasible(T).

        Feasibility is monotone in T and only changes at those values, so a bisection snapped to
        them (plus a walk to the next candidate) finds the exact optimum.
        """
        hi = max(self.time(n, self.B) for n in sizes)
        if not feasible(hi):
            return None
        lo = -math.inf
        while True:
            c = self._next_candidate(sizes, lo)
            if c >= hi:
                return hi
            if feasible(c):
                return c
            lo = c
            mid = lo + (hi - lo) / 2
            s = self._prev_candidate(sizes, mid)
            if s <= lo:
                lo = max(lo, mid)  # no candidate in (lo, mid]: feasibility there equals lo's
            elif feasible(s):
                hi = s
            else:
                lo = s

    # -- §4.2.2 batch distribution --------------------------------------------------------
    def distribute(self, node_counts: Sequence[int]) -> BatchDistribution:
        counts = list(node_counts)
        P, B = len(counts), self.B
        if P == 0:
            raise ValueError("no pipelines to distribute the batch to")
        if P > B:
            raise ValueError(f"{P} pipelines but only {B} micro-batches: each needs >= 1")
        groups: dict[int, int] = {}
        for n in counts:
            groups[n] = groups.get(n, 0) + 1
        gsizes = sorted(groups)

        def feasible(t_limit: float) -> bool:
            total = 0
            for n in gsizes:
                c = self.cap(n, t_limit)
                if c < 1:
                    return False
                total += groups[n] * c
            return total >= B

        t_star = self.min_feasible_time(gsizes, feasible)
        assert t_star is not None  # T = max time(n, B) is always feasible when P <= B
        m = [self.cap(n, t_star) for n in counts]
        excess = sum(m) - B
        # Give back the surplus from the currently slowest pipelines: keeps T* optimal and
        # evens out per-pipeline times (the variance objective of Eq. 6).
        heap = [(-self.time(n, mi), -i) for i, (n, mi) in enumerate(zip(counts, m)) if mi > 1]
        heapq.heapify(heap)
        while excess > 0:
            _, negi = heapq.heappop(heap)
            i = -negi
            m[i] -= 1
            excess -= 1
            if m[i] > 1:
                heapq.heappush(heap, (-self.time(counts[i], m[i]), -i))
        t_iter = max(self.time(n, mi) for n, mi in zip(counts, m))
        return BatchDistribution(tuple(m), t_iter)

    # -- §4.2 instantiation ---------------------------------------------------------------
    def _caps(self, t_limit: float) -> np.ndarray:
        return np.array([self.cap(n, t_limit) for n in self.sizes], dtype=np.float64)

    def _dp_full(self, caps: np.ndarray, num_nodes: int, kmax: int) -> np.ndarray:
        """best[j, k] = max total capacity of exactly k pipelines using exactly j nodes."""
        sizes = np.array(self.sizes)
        best = np.full((num_nodes + 1, kmax + 1), -np.inf)
        best[0, 0] = 0.0
        usable = caps >= 1
        for j in range(1, num_nodes + 1):
            sel = usable & (sizes <= j)
            if not sel.any():
                continue
            prev = best[j - sizes[sel], :-1] + caps[sel, None]
            best[j, 1:] = prev.max(axis=0)
        return best

    def _dp_capped(self, caps: np.ndarray, num_nodes: int) -> np.ndarray:
        """Like _dp_full but the pipeline count saturates at f+1 (column f+1 means >= f+1)."""
        f1 = self.cfg.f + 1
        sizes = np.array(self.sizes)
        best = np.full((num_nodes + 1, f1 + 1), -np.inf)
        best[0, 0] = 0.0
        usable = caps >= 1
        for j in range(1, num_nodes + 1):
            sel = usable & (sizes <= j)
            if not sel.any():
                continue
            prev = best[j - sizes[sel]] + caps[sel, None]
            if f1 > 1:
                best[j, 1:f1] = prev[:, : f1 - 1].max(axis=0)
            best[j, f1] = prev[:, f1 - 1 :].max()
        return best

    def _best_plan_dp(self, num_nodes: int) -> tuple[tuple[int, ...], float] | None:
        """Exact optimum of the enumeration in §4.2 without enumerating (unbounded knapsack).

        Plan is feasible at T iff its pipelines can finish B micro-batches (>=1 each) within T.
        Min T is found by :meth:`min_feasible_time`; ties are broken like the exhaustive path.
        """
        B, f1 = self.B, self.cfg.f + 1
        kmax = min(B, num_nodes // self.cfg.n0)
        if kmax < f1:
            return None
        use_capped = B >= num_nodes // self.cfg.n0  # then the <= B pipelines bound is slack

        def feasible(t_limit: float) -> bool:
            caps = self._caps(t_limit)
            if use_capped:
                return bool(self._dp_capped(caps, num_nodes)[num_nodes, f1] >= B)
            return bool(self._dp_full(caps, num_nodes, kmax)[num_nodes, f1:].max() >= B)

        t_star = self.min_feasible_time(self.sizes, feasible)
        if t_star is None:
            return None
        caps = self._caps(t_star)
        best = self._dp_full(caps, num_nodes, kmax)
        k_star = max(k for k in range(f1, kmax + 1) if best[num_nodes, k] >= B)
        parts: list[int] = []
        j, k, need = num_nodes, k_star, float(B)
        while k > 0:  # smallest template first => lexicographically largest (x_0, x_1, ...)
            for idx, n in enumerate(self.sizes):
                c = caps[idx]
                if c >= 1 and n <= j and best[j - n, k - 1] >= need - c:
                    parts.append(n)
                    j, k, need = j - n, k - 1, need - c
                    break
            else:  # pragma: no cover - DP invariant
                raise AssertionError("DP reconstruction failed")
        assert j == 0
        return tuple(parts), t_star

    def _best_plan_exhaustive(self, num_nodes: int) -> tuple[tuple[int, ...], float] | None:
        """§4.2.1 + §4.2.2 literally: evaluate every feasible X, keep the fastest."""
        best_key = None
        best_val: tuple[tuple[int, ...], float] | None = None
        for plan in enumerate_instantiations(self.cfg, num_nodes):
            parts = tuple(n for n in sorted(plan) for _ in range(plan[n]))
            t = self.distribute(parts).iteration_time
            key = (t, -len(parts), parts)
            if best_key is None or key < best_key:
                best_key, best_val = key, (parts, t)
        return best_val

    def best_plan(self, num_nodes: int, method: str, exhaustive_limit: int) -> tuple[tuple[int, ...], float]:
        if method not in ("auto", "exhaustive", "dp"):
            raise ValueError(f"unknown method {method!r}")
        auto_key = (num_nodes, f"auto<={exhaustive_limit}")
        if method == "auto" and auto_key in self._plans:
            return self._plans[auto_key]
        requested = method
        if method == "auto":
            n_plans = 0
            method = "exhaustive"
            for _ in enumerate_instantiations(self.cfg, num_nodes):
                n_plans += 1
                if n_plans > exhaustive_limit:
                    method = "dp"
                    break
        key = (num_nodes, method)
        if key not in self._plans:
            res = (
                self._best_plan_exhaustive(num_nodes)
                if method == "exhaustive"
                else self._best_plan_dp(num_nodes)
            )
            if res is None:
                raise ValueError(
                    f"no instantiation for {num_nodes} nodes with templates "
                    f"{self.sizes[0]}..{self.sizes[-1]}, >= {self.cfg.f + 1} pipelines and "
                    f"{self.B} micro-batches"
                )
            self._plans[key] = res
        if requested == "auto":
            self._plans[auto_key] = self._plans[key]
        return self._plans[key]


_PLANNERS: "weakref.WeakKeyDictionary[OobleckConfig, _Planner]" = weakref.WeakKeyDictionary()


def _planner(cfg: OobleckConfig) -> _Planner:
    p = _PLANNERS.get(cfg)
    if p is None:
        p = _Planner(cfg)
        _PLANNERS[cfg] = p
    return p


# --------------------------------------------------------------------------------------------
# Public planning API
# --------------------------------------------------------------------------------------------


def distribute_batch(cfg: OobleckConfig, pipeline_node_counts: Sequence[int]) -> BatchDistribution:
    """Batch distribution of §4.2.2 (and redistribution, §5.2) for the given pipelines.

    Integer micro-batch counts, each >= 1, summing to the global batch, that minimise the
    iteration time max_i pipeline_time(n_i, m_i) (the straggler; this is the objective of
    Oobleck's released planner; for linear times it is "work proportional to throughput").
    Among optimal splits, surplus is taken from the slowest pipelines to even out times (the
    variance objective of Eq. 6).  Pipelines of one template may differ by a micro-batch: the
    split is per pipeline so that every global batch >= #pipelines is distributable (the paper
    instead recommends changing the global batch, §4.2.2).
    """
    return _planner(cfg).distribute(pipeline_node_counts)


def build_instantiation(
    cfg: OobleckConfig, node_groups: Sequence[Sequence[int]], idle_nodes: Sequence[int] = ()
) -> Instantiation:
    """An Instantiation of the given pipelines (node ids in stage order) with the batch
    distributed by :func:`distribute_batch`; for tests and for simulators that track nodes.

    Every pipeline must have a template (n0 <= size <= N - f*n0) and there must be >= f+1.
    """
    sizes = [len(g) for g in node_groups]
    if any(not cfg.n0 <= n <= cfg.max_template_nodes for n in sizes):
        raise ValueError(f"pipeline sizes {sizes} outside templates {cfg.n0}..{cfg.max_template_nodes}")
    if len(sizes) < cfg.f + 1:
        raise ValueError(f"{len(sizes)} pipelines < f+1 = {cfg.f + 1}")
    ids = [u for g in node_groups for u in g] + list(idle_nodes)
    if len(set(ids)) != len(ids):
        raise ValueError("a node appears twice")
    return _build(cfg, node_groups, idle_nodes)


def _build(
    cfg: OobleckConfig, node_groups: Sequence[Sequence[int]], idle: Sequence[int] = ()
) -> Instantiation:
    dist = distribute_batch(cfg, [len(g) for g in node_groups])
    pl = _planner(cfg)
    pipes = tuple(
        PipelineInstance(tuple(g), m, pl.time(len(g), m))
        for g, m in zip(node_groups, dist.num_microbatches)
    )
    return Instantiation(pipes, dist.iteration_time, cfg.global_num_microbatches, tuple(idle))


def instantiate(
    cfg: OobleckConfig,
    num_nodes: int,
    node_ids: Sequence[int] | None = None,
    *,
    method: str = "auto",
    exhaustive_limit: int = 2000,
) -> Instantiation:
    """Fastest feasible instantiation on ``num_nodes`` nodes (§4.2).

    Candidates are all X with sum x_i n_i = num_nodes and sum x_i >= f+1 (§4.2.1, and
    <= B so each pipeline gets a micro-batch); each is scored by its optimal batch distribution
    (§4.2.2) and the highest throughput (= lowest iteration time; B is fixed) wins.  Ties go
    to more pipelines (more replicas of every layer, §3.2), then to more of the smaller
    templates (shallower pipelines, §4.1.1).

    ``method="exhaustive"`` enumerates literally; ``"dp"`` solves the same optimisation exactly
    with an unbounded-knapsack DP (the number of plans grows like integer partitions, ~10^5 at
    64 nodes); ``"auto"`` enumerates when there are at most ``exhaustive_limit`` plans.
    Pipelines are ordered by size; nodes are assigned in order from ``node_ids`` (default
    ``range(num_nodes)``).  Raises ValueError if ``num_nodes`` cannot be instantiated.
    """
    if num_nodes < cfg.min_feasible_nodes:
        raise ValueError(f"{num_nodes} nodes < (f+1)*n0 = {cfg.min_feasible_nodes}")
    ids = list(range(num_nodes)) if node_ids is None else list(node_ids)
    if len(ids) != num_nodes or len(set(ids)) != num_nodes:
        raise ValueError("node_ids must be num_nodes distinct ids")
    parts, _ = _planner(cfg).best_plan(num_nodes, method, exhaustive_limit)
    groups, pos = [], 0
    for n in parts:
        groups.append(ids[pos : pos + n])
        pos += n
    return _build(cfg, groups)


def _assign_preserving(
    parts: Sequence[int], old: Sequence[Sequence[int]], pool: Sequence[int]
) -> list[list[int]]:
    """Place nodes into new pipelines of sizes ``parts`` keeping node identity where possible.

    New pipelines (largest first) are paired with old pipelines (largest first); each keeps the
    leading nodes of its partner in order.  Everything else (partners' surplus, unpaired old
    pipelines, ``pool``) fills the remaining positions in order.  Simple, deterministic, and it
    keeps most nodes at a similar position of a similar-sized pipeline, hence few layer copies.
    """
    new_order = sorted(range(len(parts)), key=lambda i: (-parts[i], i))
    old_order = sorted(range(len(old)), key=lambda i: (-len(old[i]), i))
    groups: list[list[int]] = [[] for _ in parts]
    leftovers: list[int] = []
    for r, ni in enumerate(new_order):
        if r < len(old_order):
            src = list(old[old_order[r]])
            groups[ni] = src[: parts[ni]]
            leftovers.extend(src[parts[ni] :])
    for r in range(len(new_order), len(old_order)):
        leftovers.extend(old[old_order[r]])
    leftovers.extend(pool)
    it = iter(leftovers)
    for ni in range(len(parts)):
        while len(groups[ni]) < parts[ni]:
            groups[ni].append(next(it))
    return groups


def add_nodes(
    cfg: OobleckConfig,
    current: Instantiation,
    new_nodes: int | Sequence[int],
    *,
    method: str = "auto",
    exhaustive_limit: int = 2000,
) -> Instantiation:
    """Node additions (e.g. returning spot nodes): instantiate again from the templates (§3.3:
    "Pipeline instantiation and batch distribution happens whenever a node fails or is added").

    The plan is the §4.2 optimum for the enlarged node count; node identity is preserved where
    possible (:func:`_assign_preserving`) so :func:`layers_to_copy` charges only what moves.
    Templates stay those generated for the initial N (§3.3); if the total exceeds N and is not
    representable, the largest representable count is used and the rest stay idle.
    ``new_nodes`` is a count (ids continue after the largest known id) or explicit ids.
    """
    known = list(current.all_nodes)
    if isinstance(new_nodes, int):
        start = max(known, default=-1) + 1
        extra = list(range(start, start + new_nodes))
    else:
        extra = list(new_nodes)
        if set(extra) & set(known) or len(set(extra)) != len(extra):
            raise ValueError("added node ids must be new and distinct")
    total = len(known) + len(extra)
    reps = representable_node_counts(cfg, total)
    usable = max(reps, default=None)  # >= current.num_nodes, which is representable
    if usable is None:
        raise ValueError("not enough nodes to instantiate")
    parts, _ = _planner(cfg).best_plan(usable, method, exhaustive_limit)
    pool = list(current.idle_nodes) + extra
    groups = _assign_preserving(parts, [p.nodes for p in current.pipelines], pool)
    used = {u for g in groups for u in g}
    idle = [u for u in known + extra if u not in used]
    return _build(cfg, groups, idle)


def reinstantiate(
    cfg: OobleckConfig,
    current: Instantiation,
    failed_pipeline_node_losses: Mapping[int, int] | None = None,
    *,
    failed_nodes: Iterable[int] = (),
    num_layers: int | None = None,
) -> Instantiation | None:
    """Pipeline reinstantiation after failures (§5.1) and batch redistribution (§5.2).

    Failures are given as {pipeline index: nodes lost} (the last nodes of that pipeline are
    taken to be lost) and/or explicit ``failed_nodes`` ids.  Returns None when fewer than
    (f+1)*n0 nodes survive (Oobleck stores progress and exits, §3.4/§5), or, if ``num_layers``
    is given, when some layer lost every replica (restart from checkpoint, §3.2).

    Steps, per affected pipeline (§5.1, Figure 8):
      (a) >= n0 nodes left: simply reinstantiate from the template with that many nodes;
      (b) fewer: borrow nodes until it reaches n0 (the smallest template); lenders are idle
          nodes first, then pipelines with > n0 nodes, largest first, each yielding its last
          node and being reinstantiated one template smaller;
      (c) if lenders cannot supply enough, merge with another pipeline: another short pipeline
          if there is one (largest first), otherwise the smallest healthy pipeline.  Appendix B
          guarantees a template for any merged pipeline of >= n0 nodes (size <= N - f*n0).
    Deficient pipelines are handled most-nodes-first (they need the fewest loans).  A pipeline
    that lost every node is dropped, unless that leaves < f+1 pipelines, in which case new ones
    are formed by borrowing n0 nodes each (always possible once >= (f+1)*n0 nodes remain).
    No global re-planning happens (the paper avoids it; §1), so all surviving nodes stay in use.
    """
    n0, f1 = cfg.n0, cfg.f + 1
    failed = set(failed_nodes)
    for idx, lost in (failed_pipeline_node_losses or {}).items():
        nodes = current.pipelines[idx].nodes
        if not 0 <= lost <= len(nodes):
            raise ValueError(f"pipeline {idx} has {len(nodes)} nodes, cannot lose {lost}")
        failed.update(nodes[len(nodes) - lost :])
    unknown = failed - set(current.all_nodes)
    if unknown:
        raise ValueError(f"unknown failed nodes {sorted(unknown)}")
    if num_layers is not None and not is_recoverable(current, failed, num_layers):
        return None

    pipes: list[list[int]] = [[u for u in p.nodes if u not in failed] for p in current.pipelines]
    idle = [u for u in current.idle_nodes if u not in failed]
    total = sum(len(p) for p in pipes) + len(idle)
    if total < cfg.min_feasible_nodes:
        return None
    affected = {i for i, p in enumerate(current.pipelines) if any(u in failed for u in p.nodes)}
    if not affected:
        return _build(cfg, pipes, idle)

    def healthy(i: int) -> bool:
        return len(pipes[i]) >= n0

    def lendable(exclude: int) -> int:
        return len(idle) + sum(len(p) - n0 for j, p in enumerate(pipes) if j != exclude and len(p) > n0)

    def borrow_one(exclude: int) -> int:
        if idle:
            return idle.pop(0)
        donors = [j for j, p in enumerate(pipes) if j != exclude and len(p) > n0]
        d = max(donors, key=lambda j: (len(pipes[j]), -j))
        return pipes[d].pop()

    # (b)/(c): fix pipelines with 0 < nodes < n0.
    while True:
        short = [i for i, p in enumerate(pipes) if 0 < len(p) < n0]
        if not short:
            break
        i = max(short, key=lambda j: (len(pipes[j]), -j))
        need = n0 - len(pipes[i])
        if lendable(i) >= need:
            for _ in range(need):
                pipes[i].append(borrow_one(i))
            continue
        others_short = [j for j in short if j != i]
        if others_short:
            j = max(others_short, key=lambda k: (len(pipes[k]), -k))
            pipes[i].extend(pipes[j])  # i has at least as many nodes: it is the base
            pipes[j] = []
        else:
            j = min((k for k in range(len(pipes)) if healthy(k)), key=lambda k: (len(pipes[k]), k))
            pipes[j].extend(pipes[i])
            pipes[i] = []

    pipes = [p for p in pipes if p]
    # Keep f+1 replicas: form new pipelines from loans if whole pipelines vanished.
    while len(pipes) < f1:
        new: list[int] = []
        for _ in range(n0):
            new.append(borrow_one(-1))
        pipes.append(new)

    if any(len(p) > cfg.max_template_nodes for p in pipes) or len(pipes) > cfg.global_num_microbatches:
        # Only reachable after growing beyond N (no template fits); fall back to re-planning.
        survivors = Instantiation(
            tuple(PipelineInstance(tuple(p), 0, 0.0) for p in pipes), 0.0,
            cfg.global_num_microbatches, tuple(idle),
        )
        return add_nodes(cfg, survivors, [])
    return _build(cfg, pipes, idle)


# --------------------------------------------------------------------------------------------
# Model-state bookkeeping: what must be copied from replicas (§5: "copy missing layers")
# --------------------------------------------------------------------------------------------


def node_layer_ranges(num_layers: int, pipeline_nodes: int) -> tuple[range, ...]:
    """Layers held by each node position of a ``pipeline_nodes``-node pipeline.

    Assumption (replaces §4.1.2's profiled stage mapping): a node holds one contiguous, evenly
    sized block of layers, position i holding [floor(i*L/n), floor((i+1)*L/n)).  Stages never
    span nodes in Oobleck, so a node's layers are contiguous in any case.
    """
    if pipeline_nodes < 1:
        raise ValueError("pipeline needs >= 1 node")
    L, n = num_layers, pipeline_nodes
    return tuple(range(i * L // n, (i + 1) * L // n) for i in range(n))


def _held_layers(inst: Instantiation, num_layers: int) -> dict[int, range]:
    held: dict[int, range] = {}
    for p in inst.pipelines:
        for u, r in zip(p.nodes, node_layer_ranges(num_layers, p.num_nodes)):
            held[u] = r
    return held


def layers_to_copy_per_node(old: Instantiation, new: Instantiation, num_layers: int) -> dict[int, int]:
    """For each node of ``new``: layers its new position needs that it did not hold in ``old``.

    Assumptions: node identity is what the transition function produced (reinstantiate keeps
    surviving nodes in their pipelines; add_nodes preserves identity where possible); a node
    keeps the states of its old layers; a brand-new or previously idle node holds nothing; each
    missing layer is fetched from a surviving replica (exists whenever :func:`is_recoverable`).
    """
    held = _held_layers(old, num_layers)
    out: dict[int, int] = {}
    for p in new.pipelines:
        for u, need in zip(p.nodes, node_layer_ranges(num_layers, p.num_nodes)):
            have = held.get(u, range(0))
            overlap = max(0, min(need.stop, have.stop) - max(need.start, have.start))
            out[u] = len(need) - overlap
    return out


def layers_to_copy(old: Instantiation, new: Instantiation, num_layers: int) -> int:
    """Total layer copies from replicas for the transition old -> new (sum over nodes).

    The per-node maximum (``max(layers_to_copy_per_node(...).values())``) is the better proxy
    for wall time when copies proceed in parallel.
    """
    return sum(layers_to_copy_per_node(old, new, num_layers).values())


def surviving_layer_replicas(
    current: Instantiation, failed_nodes: Iterable[int], num_layers: int
) -> list[int]:
    """Replicas of each layer left after ``failed_nodes`` fail (one per intact holder pipeline)."""
    failed = set(failed_nodes)
    counts = [0] * num_layers
    for p in current.pipelines:
        for u, r in zip(p.nodes, node_layer_ranges(num_layers, p.num_nodes)):
            if u not in failed:
                for layer in r:
                    counts[layer] += 1
    return counts


def is_recoverable(current: Instantiation, failed_nodes: Iterable[int], num_layers: int) -> bool:
    """True iff every layer keeps at least one replica (§3.2): no checkpoint restart needed.

    Guaranteed for <= f failures since there are >= f+1 pipelines; often true beyond f.
    """
    return min(surviving_layer_replicas(current, failed_nodes, num_layers), default=1) >= 1
