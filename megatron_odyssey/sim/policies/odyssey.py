"""Odyssey: the planning layer's Planner chooses, per failure, between reroute, reconfigure and
restart by Eq. 8 (throughput x effective-time ratio), with the expected time to the next failure
from the per-device failure rate (MTBF = 1 / rate).

The paper only treats failures. For nodes that join (spot capacity returning, or spares left idle
because the job was full), we apply the same rule to three candidates: keep the plan, let the new
nodes take the places of dead nodes of a rerouted plan (they fetch their layers from a live twin
while training goes on, as a rejoining ReCycle worker does), or reconfigure onto every node.

Fail-slow (issue 15; beyond the paper): a node that gets slow is scored by Eq. 8 over carrying on,
rebalancing micro-batches off its pipeline and dropping it as if failed (``planning.slow.decide_slow``); a
dropped node is benched until it recovers, then readmitted by the join rule above, and a rebalanced plan is
rebalanced back once its slow nodes recovered. Like failures, the options are re-scored without the measured
search time, so runs are deterministic.

Variants (same policy, other planner options): ``odyssey-f1`` never chooses fewer than two pipelines
when the survivors allow (Oobleck's f = 1) instead of pricing the restart risk in Eq. 8 (the product's
rule before the risk was priced); ``odyssey-nofill`` has no bubble-filling reroute candidate;
``odyssey-ignore-slow`` does not react to slow nodes (its steps get slower); ``odyssey-slow-as-failure``
drops every slow node as if it had failed and readmits it as a join when it recovers.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ...planning.errors import PlanningError
from ...planning.estimator import fragile, score
from ...planning.plan import ExecutionPlan
from ...planning.planner import reroute_plan
from ...planning.slow import SLOW_ACTIONS, decide_slow
from ..costmodel import lost_units, plan_slowdown, relabel
from .base import FILL, KEEP, REBALANCE, RECONFIGURE, REROUTE, RESTART, START, STOP, Policy, Reaction, then

EQ8, IGNORE, AS_FAILURE = "eq8", "ignore", "as-failure"  # how a variant treats slow nodes
SLOW_MODES = (EQ8, IGNORE, AS_FAILURE)


@dataclass(frozen=True)
class _Outcome:
    plan: ExecutionPlan | None
    reaction: Reaction
    score: float = 0.0  # Eq. 8 without the search time (what the choice was made on)


@dataclass(frozen=True)
class _SlowOutcome:
    action: str  # one of planning.slow.SLOW_ACTIONS
    plan: ExecutionPlan
    reaction: Reaction


class OdysseyPolicy(Policy):
    name = "odyssey"

    def __init__(self, ctx, name: str = "odyssey", slow: str = EQ8, **planner_options: Any):
        super().__init__(ctx)
        if slow not in SLOW_MODES:
            raise ValueError(f"slow must be one of {SLOW_MODES}, got {slow!r}")
        self.name = name
        self.slow_mode = slow
        self.planner = ctx.planner_with(**planner_options)
        self.plan: ExecutionPlan | None = None
        self.stopped = False
        self.skewed = False  # the plan's micro-batches were moved off slow nodes (rebalance back on recovery)
        memo = name if planner_options else "odyssey"  # variants with the same planner share its decisions
        self._fail_memo = ctx.memo_of(f"{memo}.failure")
        self._grow_memo = ctx.memo_of(f"{memo}.grow")
        self._slow_memo = ctx.memo_of(f"{memo}.slow")

    # -- engine view -------------------------------------------------------------------------------
    def throughput(self) -> float:
        return self.cost.throughput(self.plan, self.slowdown)

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
            shapes = self.planner.search_layouts(len(nodes), max(1, len(nodes) // c.pp), c.pp)
            if not shapes:
                return None
            shape = self.planner.restart_layout(shapes, self.ctx.time_to_next_failure_s(len(nodes)))
            plan = relabel(shape, nodes)
        self.plan = plan
        self.skewed = False
        kind, cost = (RESTART, self.ctx.restart_s) if self.stopped else (START, 0.0)
        self.stopped = False
        return Reaction(kind, cost, note=f"start on {len(nodes)} nodes")

    def on_failure(self, removed, alive):
        assert self.plan is not None
        self.benched -= removed
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
        planner = self.planner
        try:
            decision = planner.decide(plan, hit)
        except PlanningError as exc:
            lost = bool(lost_units(plan, hit))
            return _Outcome(None, Reaction(STOP, 0.0, lose_since_checkpoint=lost, saves_checkpoint=not lost,
                                           note=f"no plan fits: {exc}"))
        # Re-score without the measured search time so that the choice is deterministic.
        t_next = decision.time_to_next_failure_s
        best, best_key = None, None
        for c in decision.candidates:
            if not c.feasible:
                continue
            t = c.transition.transfer_s + c.transition.overhead_s
            key = (score(self.ctx.config.global_batch, c.step_time_s, t, t_next, c.restart_risk_s), -c.step_time_s)
            if best_key is None or key > best_key:
                best, best_key = c, key
        assert best is not None and best_key is not None  # decide() raises when no candidate is feasible
        if best.policy == "restart":
            return _Outcome(best.plan, Reaction(RESTART, self.ctx.restart_s, lose_since_checkpoint=True, note=best.reason),
                            best_key[0])
        kind = REROUTE if best.policy == "reroute" else RECONFIGURE
        return _Outcome(best.plan, Reaction(kind, best.transition.transfer_s + best.transition.overhead_s,
                                            saves_checkpoint=self._fragile(best.plan), note=best.reason), best_key[0])

    def _fragile(self, plan: ExecutionPlan) -> bool:
        """As the runtime's agent, checkpoint on entering a fragile plan (asynchronous here: no time)."""
        return fragile(plan, self.planner.options.failure_bursts)

    def on_add(self, added, alive):
        """Use spare nodes if Eq. 8 says so, then see to slow nodes the (new) plan runs on."""
        if self.plan is None:
            return self.start(alive, False) or KEEP
        return then(self._use_spare(alive), self._handle_slow())

    def _use_spare(self, alive: frozenset[int]) -> Reaction:
        assert self.plan is not None
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
            s = score(gb, est.step_time_s, reaction.transition_s, self.ctx.time_to_next_failure_s(nodes),
                      self.planner.restart_risk_of(new_plan))
            options.append((s, rank, new_plan, reaction))

        options.append((score(gb, self.cost.step_time(plan), 0.0, self.ctx.time_to_next_failure_s(len(live)),
                              self.planner.restart_risk_of(plan)), 2, None, KEEP))
        if plan.failed:
            filled = _fill(plan, spare)
            if filled is not None:
                consider(1, filled, Reaction(FILL, prof.reroute_overhead_s, note="new nodes take dead nodes' places"),
                         len(filled.live_nodes()))
        n = len(live) + len(spare)
        holdings = dict(plan.holdings())
        holdings.update({s: frozenset() for s in spare})
        # as the runtime's decide_join (Planner.best_reconfiguration): Eq. 8 over the best few layouts, so a
        # slightly slower one whose next failure cannot force a restart can win over the fastest
        for shape in self.planner.search_layouts(n, len(plan.pipelines),
                                                 max(1, round(len(plan.nodes()) / len(plan.pipelines))))[
                : self.planner.options.transfer_top]:
            try:
                new_plan, transfer_s = self.cost.assign(holdings, shape)
            except PlanningError:
                continue
            consider(0, new_plan, Reaction(RECONFIGURE, transfer_s + prof.rebuild_overhead_s,
                                           note=f"reconfigure onto {n} nodes"), n)
        best = max(options, key=lambda o: (o[0], o[1]))
        if best[2] is not None and self._fragile(best[2]):
            return _Outcome(best[2], replace(best[3], saves_checkpoint=True))
        return _Outcome(best[2], best[3])


    # -- fail-slow -----------------------------------------------------------------------------------
    def on_slow(self, slow, alive):
        """Bench known-slow nodes the plan does not use, react to the slow nodes it uses, and readmit benched
        nodes that recovered (Eq. 8 over keep / fill dead places / reconfigure, as for any join)."""
        if self.slow_mode == IGNORE or self.plan is None:
            return KEEP
        recovered = {n for n in self.benched if n not in slow}
        self.benched = {n for n in self.benched if n in slow and n in alive}
        self.benched |= set(slow) - set(self.plan.live_nodes())
        reaction = self._handle_slow()
        if recovered and self.plan is not None:
            reaction = then(reaction, self.on_add(frozenset(), alive))
        return reaction

    def _handle_slow(self) -> Reaction:
        """React to the slow nodes the plan uses (and, after a rebalance, to their recovery)."""
        if self.slow_mode == IGNORE or self.plan is None:
            return KEEP
        slow = dict(plan_slowdown(self.plan, self.slowdown))
        if self.slow_mode == AS_FAILURE:
            return self._drop(frozenset(slow)) if slow else KEEP
        if not slow and not self.skewed:
            return KEEP
        key = (self.plan, tuple(sorted(slow.items())))
        out = self._slow_memo.get(key)
        if out is None:
            out = self._slow_memo[key] = self._decide_slow(self.plan, slow)
        if out.action == "none":
            if not slow:
                self.skewed = False
            return KEEP
        self.plan = out.plan
        if out.action == "drop":
            self.benched |= set(slow)
            self.skewed = False
        else:
            self.skewed = bool(slow)
        return out.reaction

    def _drop(self, nodes: frozenset[int]) -> Reaction:
        """Take slow ``nodes`` out as if failed (the failure decision); they are benched until they recover."""
        assert self.plan is not None
        out = self._dropped(self.plan, nodes)
        if out.plan is None:  # nothing runs without them: carry on slowed
            return KEEP
        self.plan = out.plan
        self.benched |= set(nodes)
        self.skewed = False
        return out.reaction

    def _dropped(self, plan: ExecutionPlan, nodes: frozenset[int]) -> _Outcome:
        """The failure decision for slow ``nodes``; a slow node still holds its state, so a restart saves first
        and loses nothing (a voluntary restart), and no step in flight is lost."""
        key = (plan, nodes)
        out = self._fail_memo.get(key)
        if out is None:
            out = self._fail_memo[key] = self._decide(plan, nodes)
        if out.plan is None:
            return out
        r = out.reaction
        if r.kind == RESTART:
            r = Reaction(RESTART, self.ctx.voluntary_restart_s, saves_checkpoint=True, note=r.note)
        return _Outcome(out.plan, Reaction(r.kind, r.transition_s, r.lose_since_checkpoint, r.saves_checkpoint,
                                           f"drop slow node(s) {sorted(nodes)}: {r.note}"), out.score)

    def _decide_slow(self, plan: ExecutionPlan, slow: dict[int, float]) -> _SlowOutcome:
        """Eq. 8 over carry on / rebalance (``decide_slow``'s options) / drop (the failure decision, as
        ``decide_slow`` takes it, re-scored without the measured search time like every failure)."""
        decision = decide_slow(self.planner, plan, slow)
        options: list[tuple[float, str, ExecutionPlan, Reaction]] = []
        for o in decision.options:
            c = o.candidate
            if o.action == "none":
                options.append((c.score, "none", plan, KEEP))
            elif o.action == "rebalance" and c.feasible:
                t = c.transition.transfer_s + c.transition.overhead_s
                why = "readmit: " if not slow else ""
                options.append((c.score, "rebalance", c.plan, Reaction(REBALANCE, t, note=why + c.reason)))
            elif o.action == "drop" and c.feasible:
                out = self._dropped(plan, frozenset(slow))
                if out.plan is not None:
                    options.append((out.score, "drop", out.plan, out.reaction))
        best = max(options, key=lambda o: (o[0], -SLOW_ACTIONS.index(o[1])))
        return _SlowOutcome(best[1], best[2], best[3])


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
