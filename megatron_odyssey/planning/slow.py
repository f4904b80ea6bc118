"""What to do about a slow node (fail-slow): carry on, rebalance, or drop it, by Eq. 8.

A slow node is not dead: the agent's diagnosis measures how much slower its compute is (a factor, see
``runtime.diagnosis``) and asks here. Three options, each a plan with its Eq. 8 score:

- **none** (carry on): the current plan, every operation of the slow node taking ``factor`` times as long
  (the Eq. 11 play with per-node speeds, ``estimator.simulate(slowdown=)``); no transition.
- **rebalance**: the same layout, the global batch's micro-batches moved from the slow node's pipeline to the
  others until the slowest pipeline is as fast as it gets; no weights move, but every rank rebuilds its
  groups and one step is redone (the runtime re-plans at a step boundary).
- **drop**: the slow nodes taken out as if they had failed: the planner's own failure decision (reroute or
  reconfigure) on the others. Never a restart: a slow node still holds its layers, which a restart would load
  from the last checkpoint (losing the work since, or everything when there is none), on a diagnosis that
  may be wrong (the restart risk Eq. 8 prices is a chance, this one a certainty).

A node whose factor falls back to 1 is *readmitted* by the same rule: with no slowdown left, the balanced
split scores best again. Moving layers off a slow node (an asymmetric layer split with per-node speeds) is
not among the options yet: the layer search does not take per-node speeds.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from .errors import PlanningError
from .estimator import estimate_step, score, simulate
from .plan import ExecutionPlan, Pipeline
from .planner import ActionOption, Candidate, Planner, Transition, reroute_plan

SLOW_ACTIONS = ("none", "rebalance", "drop")


@dataclass
class SlowDecision:
    action: str
    chosen: ActionOption
    options: list[ActionOption]
    slowdown: dict[int, float]
    time_to_next_failure_s: float

    @property
    def plan(self) -> ExecutionPlan | None:
        return self.chosen.candidate.plan

    def to_json(self) -> dict[str, Any]:
        return {"action": self.action, "slowdown": {str(n): f for n, f in sorted(self.slowdown.items())},
                "reason": self.chosen.candidate.reason, "time_to_next_failure_s": self.time_to_next_failure_s,
                "options": [o.summary() for o in self.options]}


def decide_slow(planner: Planner, current: ExecutionPlan, slowdown: Mapping[int, float]) -> SlowDecision:
    """Eq. 8 over carrying on, rebalancing and dropping, for ``current`` with ``slowdown`` (node -> compute
    slowdown factor, >= 1; an empty mapping asks whether a rebalanced plan should go back to balanced)."""
    live = set(current.live_nodes())
    bad = {n: f for n, f in slowdown.items() if n not in live or not f >= 1.0}
    if bad:
        raise PlanningError(f"slowdown {bad}: nodes must be live in the current plan and factors >= 1")
    slow = {n: float(f) for n, f in slowdown.items() if f > 1.0}
    profile, tp = planner.profile, planner.options.tp
    t_next = planner.options.mtbf_hours * 3600.0 / (len(live) * tp)
    carry = Candidate(current.policy, current, estimate_step(current, profile, slowdown=slow),
                      reason=_carry_reason(slow))
    options = [ActionOption("none", carry)]
    balanced = rebalanced(current, planner, slow)
    if balanced is not None:
        step = estimate_step(balanced, profile, slowdown=slow)
        # the runtime re-plans at a step boundary: the groups are rebuilt and the step in flight is redone
        transition = Transition(overhead_s=profile.rebuild_overhead_s + carry.step_time_s)
        counts = [p.micro_batches for p in balanced.pipelines]
        options.append(ActionOption("rebalance", Candidate("reconfigure", balanced, step, transition, reason=(
            f"micro-batches per pipeline {[p.micro_batches for p in current.pipelines]} -> {counts}"
            + (f" so that slow node(s) {sorted(slow)} do less" if slow else ": every node at full speed again")))))
    if slow and len(slow) < len(live):
        try:
            dropped = planner.decide(current, frozenset(slow))
            c = dropped.chosen
            if c.kind == "restart":  # a slow node still holds what a restart would have to load from disk
                options.append(ActionOption("drop", Candidate("restart", None, reason=(
                    f"not dropping slow node(s) {sorted(slow)}: without them {c.reason}; a diagnosis never "
                    f"restarts the job"))))
            else:
                options.append(ActionOption("drop", replace(c, reason=f"drop slow node(s) {sorted(slow)} as "
                                                                   f"failed: {c.kind}, {c.reason}")))
        except PlanningError as exc:
            options.append(ActionOption("drop", Candidate("reroute", None, reason=f"cannot drop: {exc}")))
    for o in options:
        c = o.candidate
        if c.feasible and o.action != "drop":  # (the drop's score is the failure decision's own)
            c.restart_risk_s = planner.restart_risk_of(c.plan)
            c.score = score(planner.global_batch, c.step_time_s, c.transition.total_s, t_next, c.restart_risk_s)
    feasible = [o for o in options if o.candidate.feasible]
    # ties keep the cheaper action: carry on before rebalancing before dropping
    chosen = max(feasible, key=lambda o: (o.candidate.score, -SLOW_ACTIONS.index(o.action)))
    return SlowDecision(chosen.action, chosen, options, slow, t_next)


def _carry_reason(slow: Mapping[int, float]) -> str:
    if not slow:
        return "the current plan"
    return "carry on with " + ", ".join(f"node {n} {f:.2g}x slower" for n, f in sorted(slow.items()))


def rebalanced(current: ExecutionPlan, planner: Planner, slow: Mapping[int, float]) -> ExecutionPlan | None:
    """``current`` with the global batch's micro-batches split over its pipelines so that the slowest pipeline
    is as fast as it can be (Eq. 11 play with per-node speeds); None when that is no faster than ``current``
    or there is one pipeline. Without ``slow`` this finds the balance again.

    Each pipeline's time grows with its micro-batches, so handing them out one at a time, each to the pipeline
    that is fastest with one more, minimises the slowest (the classic greedy for min-max of monotone costs).
    A pipeline's time is played on its own; a rerouted plan (whose pipelines share the dead nodes' work) gets
    its table rebuilt for the new counts and is played whole before it is offered."""
    k_max = len(current.pipelines)
    if k_max < 2:
        return None
    profile = planner.profile
    memo: dict[tuple[int, int], float] = {}

    def alone(k: int, m: int) -> float:
        if (k, m) not in memo:
            pipe = current.pipelines[k]
            one = ExecutionPlan("reconfigure", current.num_layers, (Pipeline(pipe.stages, m),))
            memo[(k, m)] = simulate(one, profile, slowdown=slow).pipeline_times[0]
        return memo[(k, m)]

    counts = [1] * k_max
    for _ in range(current.num_micro_batches - k_max):
        k = min(range(k_max), key=lambda k: (alone(k, counts[k] + 1), k))
        counts[k] += 1
    if counts == [p.micro_batches for p in current.pipelines]:
        return None
    plan = replace(current, policy="reconfigure", reroutes=(), reason="rebalanced micro-batches",
                   pipelines=tuple(Pipeline(p.stages, m) for p, m in zip(current.pipelines, counts)))
    if current.failed:
        rerouted = reroute_plan(plan, current.failed)
        if isinstance(rerouted, str):
            return None
        plan = replace(rerouted, policy="reconfigure", fill=current.fill, stagger=current.stagger,
                       reason="rebalanced micro-batches")
    before = max(simulate(current, profile, slowdown=slow).pipeline_times)
    return plan if max(simulate(plan, profile, slowdown=slow).pipeline_times) < before - 1e-12 else None
