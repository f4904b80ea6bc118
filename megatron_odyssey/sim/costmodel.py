"""One cost model for every policy: step times from the planning estimator, transfer times from
the restorer, memoised because the same layouts recur across events, policies and seeds.

Like for like: no policy gets a step or transition time from anywhere else. (ReCycle's adaptive
schedule adds a bubble-filling model on top of the estimator's per-stage costs, see
``normalisation.py``.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from ..planning.errors import PlanningError
from ..planning.estimator import estimate_step
from ..planning.partition import PipelineModel, split_layers
from ..planning.plan import ExecutionPlan, Pipeline, Stage, layout
from ..planning.profile import ModelProfile
from ..planning.restorer import match_positions, schedule_transfers
from .templates import TemplateModel

Shape = tuple[tuple[tuple[int, ...], int], ...]  # ((layer split, micro-batches), ...) per pipeline


@dataclass(frozen=True)
class Estimate:
    step_time_s: float
    fits_memory: bool


def plan_shape(plan: ExecutionPlan) -> Shape:
    return tuple((p.layer_split(), p.micro_batches) for p in plan.pipelines)


def relabel(plan: ExecutionPlan, nodes: list[int] | dict[int, int]) -> ExecutionPlan:
    """The same plan on other nodes: a list gives the nodes in plan order, a dict maps old -> new."""
    if isinstance(nodes, dict):
        mapping = nodes
    else:
        mapping = dict(zip(plan.nodes(), nodes))
    pipes = tuple(Pipeline(tuple(Stage(mapping[s.node], s.layer_start, s.layer_end) for s in p.stages),
                           p.micro_batches) for p in plan.pipelines)
    return ExecutionPlan(plan.policy, plan.num_layers, pipes, failed=frozenset(mapping.get(n, n) for n in plan.failed),
                         reroutes=tuple(type(r)(r.pipeline, r.stage, r.micro_batch, mapping[r.peer]) for r in plan.reroutes),
                         reason=plan.reason)


class CostModel:
    """Step times, layer splits, symmetric layouts and transfer times of one job."""

    def __init__(self, profile: ModelProfile, num_micro_batches: int, micro_batch: int):
        self.profile = profile
        self.num_micro_batches = num_micro_batches
        self.micro_batch = micro_batch
        self.samples_per_step = num_micro_batches * micro_batch
        self.model = PipelineModel(profile)
        self.unit_bytes = [u.state_bytes for u in profile.units()]
        self._by_shape: dict[Shape, Estimate] = {}
        self._by_plan: dict[Any, Estimate] = {}  # plan, or ("staggered", plan)
        self._symmetric: dict[int, tuple[int, int, tuple[int, ...]] | None] = {}
        self.templates = TemplateModel(profile)
        self._compute: dict[tuple[int, int], float] = {}
        self._min_nodes: int | None | bool = False

    # -- step times --------------------------------------------------------------------------------
    def estimate(self, plan: ExecutionPlan, staggered: bool = False,
                 slowdown: Mapping[int, float] | None = None) -> Estimate:
        """The planning estimator's step time (Eq. 10/11 + sync rounds + optimizer), memoised by
        layout shape for plain plans and by the whole plan for rerouted ones; ``staggered``: with
        ReCycle's staggered optimizer (filled plans; the ReCycle baseline only); ``slowdown``: node ->
        factor of fail-slow nodes (those the plan does not run on are ignored)."""
        slow = plan_slowdown(plan, slowdown)
        if slow:
            key = ("slow", staggered, plan, slow)
            hit = self._by_plan.get(key)
            if hit is None:
                e = estimate_step(plan, self.profile, staggered, dict(slow))
                hit = self._by_plan[key] = Estimate(e.step_time_s, e.fits_memory)
            return hit
        if not staggered and not plan.failed and not plan.reroutes:
            key = plan_shape(plan)
            hit = self._by_shape.get(key)
            if hit is None:
                e = estimate_step(plan, self.profile)
                hit = self._by_shape[key] = Estimate(e.step_time_s, e.fits_memory)
            return hit
        key = ("staggered", plan) if staggered else plan
        hit = self._by_plan.get(key)
        if hit is None:
            e = estimate_step(plan, self.profile, staggered)
            hit = self._by_plan[key] = Estimate(e.step_time_s, e.fits_memory)
        return hit

    def step_time(self, plan: ExecutionPlan, staggered: bool = False,
                  slowdown: Mapping[int, float] | None = None) -> float:
        return self.estimate(plan, staggered, slowdown).step_time_s

    def throughput(self, plan: ExecutionPlan | None, slowdown: Mapping[int, float] | None = None) -> float:
        """Samples per second of ``plan`` (0 for no plan), with its fail-slow nodes' ``slowdown``."""
        if plan is None:
            return 0.0
        t = self.step_time(plan, slowdown=slowdown)
        return self.samples_per_step / t if math.isfinite(t) and t > 0 else 0.0

    def ideal_throughput(self, num_nodes: int) -> float:
        """Every node busy all the time, no bubbles, no communication: no layout of ``num_nodes``
        nodes can beat it (step >= M * W / n, W = one micro-batch through the whole model)."""
        work = sum(u.forward_s + u.backward_s for u in self.profile.units())
        return num_nodes * self.micro_batch / work if work > 0 else math.inf

    # -- layouts -----------------------------------------------------------------------------------
    def split(self, stages: int, micro_batches: int) -> tuple[int, ...] | None:
        """Odyssey's layer split (even, remainder placements, then balancing) that fits memory."""
        if stages > self.profile.num_layers or micro_batches < 1:
            return None
        return split_layers(self.model, stages, micro_batches)

    def pipeline_compute(self, stages: int, micro_batches: int) -> float:
        """Compute time of one pipeline of ``stages`` nodes (inf if no split fits memory)."""
        key = (stages, micro_batches)
        t = self._compute.get(key)
        if t is None:
            split = self.split(stages, micro_batches)
            t = self._compute[key] = math.inf if split is None else self.model.time(split, micro_batches)
        return t

    def min_pipeline_nodes(self) -> int | None:
        """Fewest nodes that hold one model replica at the deepest 1F1B in-flight count (Eq. 14)."""
        if self._min_nodes is False:
            self._min_nodes = next((n for n in range(1, self.profile.num_layers + 1)
                                    if self.split(n, n) is not None), None)
        return self._min_nodes  # type: ignore[return-value]

    def plan_of_shape(self, shape: list[tuple[tuple[int, ...], int]], nodes: list[int], policy: str) -> ExecutionPlan:
        return layout(list(shape), nodes, self.profile.num_layers, policy=policy)

    def symmetric(self, pp: int, dp: int, nodes: list[int], policy: str = "restart",
                  split: tuple[int, ...] | None = None) -> ExecutionPlan | None:
        """DP identical pipelines of PP nodes (node of stage s in replica d = nodes[s*DP + d], Megatron's
        order), with the given layer split or the estimator's best one; None if the batch does not divide
        or memory is short."""
        if self.num_micro_batches % dp:
            return None
        m = self.num_micro_batches // dp
        split = split or self.split(pp, m)
        if split is None:
            return None
        placeholder = layout([(split, m)] * dp, list(range(pp * dp)), self.profile.num_layers, policy=policy)
        # layout() numbers nodes pipeline by pipeline; Megatron numbers them stage-major
        order = {d * pp + s: nodes[s * dp + d] for d in range(dp) for s in range(pp)}
        return relabel(placeholder, order)

    def best_symmetric(self, num_nodes: int) -> tuple[int, int, tuple[int, ...]] | None:
        """The fastest (PP, DP, layer split) with PP x DP <= num_nodes, DP dividing the micro-batches, fitting
        memory: Varuna's "best symmetric configuration of the survivors". Shapes are ranked by the template
        model's closed-form 1F1B time (min-max layer split, ``templates.py``), the best few timed by the
        estimator."""
        if num_nodes in self._symmetric:
            return self._symmetric[num_nodes]
        ranked = []
        for pp in range(1, min(num_nodes, self.profile.num_layers) + 1):
            dp = max((d for d in range(1, num_nodes // pp + 1) if self.num_micro_batches % d == 0), default=0)
            if dp == 0:
                continue
            t = self.templates.pipeline_time(pp, self.num_micro_batches // dp)
            if math.isfinite(t):
                ranked.append((t, pp, dp))
        best, best_t = None, math.inf
        for _, pp, dp in sorted(ranked)[:4]:  # sync and optimizer only add; time the fastest few exactly
            split = self.templates.template(pp)[0]
            plan = self.symmetric(pp, dp, list(range(pp * dp)), split=split)
            if plan is not None:
                e = self.estimate(plan)
                if e.fits_memory and e.step_time_s < best_t:
                    best, best_t = (pp, dp, split), e.step_time_s
        self._symmetric[num_nodes] = best
        return best

    def best_symmetric_plan(self, nodes: list[int], policy: str = "restart") -> ExecutionPlan | None:
        best = self.best_symmetric(len(nodes))
        if best is None:
            return None
        pp, dp, split = best
        return self.symmetric(pp, dp, nodes[: pp * dp], policy=policy, split=split)

    # -- transfers ---------------------------------------------------------------------------------
    def transfer_time(self, holdings: dict[int, frozenset[int]], targets: dict[int, frozenset[int]]) -> float:
        """Copy every unit a node needs and lacks from a live holder; links work in parallel, each
        carrying what it sends or receives (the restorer's schedule). Raises PlanningError if a unit
        has no live copy."""
        sched = schedule_transfers(holdings, targets, self.unit_bytes)
        return sched.time_s(self.profile.transfer_bandwidth_Bps)

    def assign(self, holdings: dict[int, frozenset[int]], target: ExecutionPlan) -> tuple[ExecutionPlan, float]:
        """Put the nodes of ``holdings`` (new nodes hold nothing) on the positions of ``target``
        (placeholder ids) with the fewest bytes to move (Kuhn-Munkres, Odyssey IV-B); returns the plan
        and its transfer time."""
        nodes = sorted(holdings)
        positions = [(k, i) for k, p in enumerate(target.pipelines) for i in range(p.length)]
        if len(positions) != len(nodes):
            raise PlanningError(f"{len(nodes)} nodes cannot fill {len(positions)} positions")
        new_units = [target.stage_units(k, i) for k, i in positions]
        owner, _ = match_positions([holdings[n] for n in nodes], new_units, self.unit_bytes)
        node_at = {pos: nodes[owner[j]] for j, pos in enumerate(positions)}
        pipes = tuple(Pipeline(tuple(Stage(node_at[(k, i)], s.layer_start, s.layer_end) for i, s in enumerate(p.stages)),
                               p.micro_batches) for k, p in enumerate(target.pipelines))
        plan = ExecutionPlan(target.policy, target.num_layers, pipes, reason=target.reason)
        targets = {node_at[pos]: units for pos, units in zip(positions, new_units)}
        return plan, self.transfer_time(holdings, targets)


def plan_slowdown(plan: ExecutionPlan, slowdown: Mapping[int, float] | None) -> tuple[tuple[int, float], ...]:
    """The factors (> 1) of the slow nodes ``plan`` runs on, sorted: what its step time depends on."""
    if not slowdown:
        return ()
    live = set(plan.live_nodes())
    return tuple(sorted((n, float(f)) for n, f in slowdown.items() if f > 1.0 and n in live))


def holdings_of(plan: ExecutionPlan | None) -> dict[int, frozenset[int]]:
    return {} if plan is None else plan.holdings()


def lost_units(plan: ExecutionPlan, dead: frozenset[int] | set[int]) -> list[int]:
    """Units (embedding, layers, output) with no live holder once ``dead`` nodes are gone."""
    alive_holders: dict[int, int] = {u: 0 for u in range(plan.num_layers + 2)}
    pos = plan.position_of()
    for node, (k, i) in pos.items():
        if node in plan.failed or node in dead:
            continue
        for u in plan.stage_units(k, i):
            alive_holders[u] += 1
    return [u for u, c in alive_holders.items() if c == 0]
