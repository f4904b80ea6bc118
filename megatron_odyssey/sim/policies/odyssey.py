"""Odyssey: the planning layer's Planner chooses, per failure, between reroute, reconfigure and
restart by Eq. 8 (throughput x effective-time ratio), with the expected time to the next failure
from the per-device failure rate (MTBF = 1 / rate).

The paper only treats failures. For nodes that join (spot capacity returning, or spares left idle
because the job was full), we apply the same rule to three candidates: keep the plan, let the new
nodes take the places of dead nodes of a rerouted plan (they fetch their layers from a live twin
while training goes on, as a rejoining ReCycle worker does), or reconfigure onto every node.

``odyssey-f1`` is a diagnostic variant, not the paper's system: the same Planner, but layouts with
fewer than two pipelines are replaced by the best layout that keeps two (Oobleck's f = 1). Eq. 8 does
not price the risk of a layout in which some layer has a single copy, and the Planner drifts to one
long pipeline when that is fastest; the next failure then forces a checkpoint restart.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...planning.errors import PlanningError
from ...planning.estimator import estimate_step, score
from ...planning.plan import ExecutionPlan
from ...planning.planner import Candidate, Transition, reroute_plan
from ...planning.restorer import assign_nodes
from ..costmodel import lost_units, relabel
from .base import FILL, KEEP, RECONFIGURE, REROUTE, RESTART, START, STOP, Policy, Reaction, then


@dataclass(frozen=True)
class _Outcome:
    plan: ExecutionPlan | None
    reaction: Reaction


class OdysseyPolicy(Policy):
    name = "odyssey"

    def __init__(self, ctx, min_pipelines: int = 1):
        super().__init__(ctx)
        self.min_pipelines = min_pipelines
        if min_pipelines > 1:
            self.name = f"odyssey-f{min_pipelines - 1}"
        self.plan: ExecutionPlan | None = None
        self.stopped = False
        self._fail_memo = ctx.memo_of(f"{self.name}.failure")
        self._grow_memo = ctx.memo_of(f"{self.name}.grow")

    # -- engine view -------------------------------------------------------------------------------
    def throughput(self) -> float:
        return self.cost.throughput(self.plan)

    def nodes_in_use(self) -> frozenset[int]:
        return frozenset(self.plan.live_nodes()) if self.plan else frozenset()

    @property
    def running(self) -> bool:
        return self.plan is not None

    # -- reactions ---------------------------------------------------------------------------------
    def start(self, alive, full_launch):
        nodes = self.pick(alive)
        plan = self.ctx.initial_plan(nodes) if full_launch else None
        if plan is None:
            # Algorithm 1 searches around a current DP; from scratch, take the configured pipeline length
            c = self.ctx.config
            shape = self.ctx.planner.search_layout(len(nodes), max(1, len(nodes) // c.pp), c.pp)
            if shape is None:
                return None
            plan = relabel(shape, nodes)
        self.plan = plan
        kind, cost = (RESTART, self.ctx.restart_s) if self.stopped else (START, 0.0)
        self.stopped = False
        return Reaction(kind, cost, note=f"start on {len(nodes)} nodes")

    def on_failure(self, removed, alive):
        assert self.plan is not None
        hit = frozenset(removed) & frozenset(self.plan.live_nodes())
        if not hit:
            return KEEP
        key = (self.plan, hit)
        out = self._fail_memo.get(key)
        if out is None:
            out = self._fail_memo[key] = self._decide(self.plan, hit)
        self.plan = out.plan
        if self.plan is None:
            self.stopped = True
            return out.reaction
        return then(out.reaction, self.on_add(frozenset(), alive))

    def _decide(self, plan: ExecutionPlan, hit: frozenset[int]) -> _Outcome:
        planner = self.ctx.planner
        try:
            decision = planner.decide(plan, hit)
        except PlanningError as exc:
            lost = bool(lost_units(plan, hit))
            return _Outcome(None, Reaction(STOP, 0.0, lose_since_checkpoint=lost, saves_checkpoint=not lost,
                                           note=f"no plan fits: {exc}"))
        # Re-score without the measured search time so that the choice is deterministic.
        t_next = decision.time_to_next_failure_s
        candidates = [c for c in decision.candidates if c.feasible]
        if self.min_pipelines > 1:
            candidates = [c for c in candidates if len(c.plan.pipelines) >= self.min_pipelines]
            candidates += self._redundant_candidates(plan, hit)
        best, best_key = None, None
        for c in candidates:
            t = c.transition.transfer_s + c.transition.overhead_s
            key = (score(self.ctx.config.global_batch, c.step_time_s, t, t_next), -c.step_time_s)
            if best_key is None or key > best_key:
                best, best_key = c, key
        if best is None:
            return _Outcome(None, Reaction(STOP, 0.0, lose_since_checkpoint=True,
                                           note=f"no layout with {self.min_pipelines} pipelines fits"))
        if best.policy == "restart":
            return _Outcome(best.plan, Reaction(RESTART, self.ctx.restart_s, lose_since_checkpoint=True, note=best.reason))
        kind = REROUTE if best.policy == "reroute" else RECONFIGURE
        return _Outcome(best.plan, Reaction(kind, best.transition.transfer_s + best.transition.overhead_s,
                                            note=best.reason))

    def _redundant_candidates(self, plan: ExecutionPlan, hit: frozenset[int]) -> list[Candidate]:
        """Reconfigure/restart candidates among the Planner's layouts with >= min_pipelines pipelines."""
        planner, prof = self.ctx.planner, self.ctx.profile
        dead_view = ExecutionPlan(plan.policy, plan.num_layers, plan.pipelines, failed=plan.failed | hit)
        survivors = dead_view.live_nodes()
        typical = max(1, round(len(plan.nodes()) / len(plan.pipelines)))
        dp = max(self.min_pipelines, len(plan.pipelines))
        search = getattr(planner, "search_layouts", None)
        shapes = search(len(survivors), dp, typical) if search else [planner.search_layout(len(survivors), dp, typical)]
        shapes = [s for s in shapes if s is not None and len(s.pipelines) >= self.min_pipelines]
        lost = lost_units(plan, hit)
        out = []
        for shape in shapes:
            if lost:
                restart = relabel(ExecutionPlan("restart", shape.num_layers, shape.pipelines), survivors)
                out.append(Candidate("restart", restart, estimate_step(restart, prof),
                                     Transition(overhead_s=prof.restart_overhead_s + prof.checkpoint_interval_s / 2),
                                     reason="no live copy of some layer: restore the last checkpoint"))
            else:
                new_plan, transfers = assign_nodes(dead_view, shape, prof)
                out.append(Candidate("reconfigure", new_plan, estimate_step(new_plan, prof),
                                     Transition(transfer_s=transfers.time_s(prof.transfer_bandwidth_Bps),
                                                overhead_s=prof.rebuild_overhead_s),
                                     reason=f"{len(new_plan.pipelines)} pipelines of lengths "
                                            f"{[p.length for p in new_plan.pipelines]} (>= {self.min_pipelines})"))
        return out

    def on_add(self, added, alive):
        if self.plan is None:
            return self.start(alive, False) or KEEP
        spare = self.spare(alive)
        if not spare:
            return KEEP
        key = (self.plan, tuple(spare))
        out = self._grow_memo.get(key)
        if out is None:
            out = self._grow_memo[key] = self._grow(self.plan, spare)
        if out.plan is not None:
            self.plan = out.plan
        return out.reaction

    def _grow(self, plan: ExecutionPlan, spare: list[int]) -> _Outcome:
        """Eq. 8 over keep / fill dead places / reconfigure onto every node."""
        gb = self.ctx.config.global_batch
        prof = self.ctx.profile
        live = plan.live_nodes()
        options: list[tuple[float, int, ExecutionPlan | None, Reaction]] = []

        def consider(rank: int, new_plan: ExecutionPlan, reaction: Reaction, nodes: int) -> None:
            est = self.cost.estimate(new_plan)
            if not est.fits_memory:
                return
            s = score(gb, est.step_time_s, reaction.transition_s, self.ctx.time_to_next_failure_s(nodes))
            options.append((s, rank, new_plan, reaction))

        options.append((score(gb, self.cost.step_time(plan), 0.0, self.ctx.time_to_next_failure_s(len(live))),
                        2, None, KEEP))
        if plan.failed:
            filled = _fill(plan, spare)
            if filled is not None:
                consider(1, filled, Reaction(FILL, prof.reroute_overhead_s, note="new nodes take dead nodes' places"),
                         len(filled.live_nodes()))
        n = len(live) + len(spare)
        shape = self.ctx.planner.search_layout(n, len(plan.pipelines), max(1, round(len(plan.nodes()) / len(plan.pipelines))))
        if shape is not None:
            holdings = dict(plan.holdings())
            holdings.update({s: frozenset() for s in spare})
            try:
                new_plan, transfer_s = self.cost.assign(holdings, shape)
                consider(0, new_plan, Reaction(RECONFIGURE, transfer_s + prof.rebuild_overhead_s,
                                               note=f"reconfigure onto {n} nodes"), n)
            except PlanningError:
                pass
        best = max(options, key=lambda o: (o[0], o[1]))
        return _Outcome(best[2], best[3])


def _fill(plan: ExecutionPlan, spare: list[int]) -> ExecutionPlan | None:
    """New nodes take the places of dead ones, most crowded stage (most dead twins) first; the
    rest stays rerouted."""
    pos = plan.position_of()
    dead = [n for n in plan.failed if n in pos]
    twins: dict[frozenset[int], int] = {}
    for n in dead:
        units = plan.stage_units(*pos[n])
        twins[units] = twins.get(units, 0) + 1
    dead.sort(key=lambda n: (-twins[plan.stage_units(*pos[n])], pos[n]))
    mapping = dict(zip(dead, spare))
    if not mapping:
        return None
    remaining = plan.failed - set(mapping)
    base = ExecutionPlan("reconfigure", plan.num_layers, plan.pipelines)
    moved = relabel(base, {n: mapping.get(n, n) for n in plan.nodes()})
    if not remaining:
        return moved
    rerouted = reroute_plan(moved, frozenset(remaining))
    return rerouted if isinstance(rerouted, ExecutionPlan) else None
