"""What to do with nodes that (re)join a running job, by Eq. 8: hold them, fill dead places, or reconfigure.

Spot capacity returns and repaired machines come back. Three options, each a plan with its Eq. 8 score
(``estimator.score``, the time to the next failure counted over the nodes the plan uses):

- **standby**: keep the current plan; the new nodes wait (a later re-plan can use them).
- **fill**: in a rerouted plan, new nodes take dead nodes' places (the most crowded stage first), fetching
  that stage's weights and optimizer state from a live twin; the rest stays rerouted.
- **reconfigure**: Algorithm 1 over every node, old and new; the new ones hold nothing, so the assignment
  (Kuhn-Munkres over bytes to move) puts the survivors where they already hold most.

Filling and reconfiguring are started at a step boundary (the runtime redoes the step in flight on the new
plan), so their transition also counts one step of the current plan and the groups' rebuild.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import PlanningError
from .estimator import estimate_step, score
from .plan import ExecutionPlan, Pipeline, Stage
from .planner import ActionOption, Candidate, Planner, Transition, reroute_plan
from .restorer import TransferSchedule, assign_nodes, schedule_transfers

JOIN_ACTIONS = ("standby", "fill", "reconfigure")


@dataclass
class JoinDecision:
    action: str
    chosen: ActionOption
    options: list[ActionOption]
    joining: tuple[int, ...]

    @property
    def plan(self) -> ExecutionPlan:
        return self.chosen.candidate.plan


def decide_join(planner: Planner, current: ExecutionPlan, joining: list[int] | tuple[int, ...]) -> JoinDecision:
    """Eq. 8 over standby / fill / reconfigure for ``joining`` nodes (ids not live in ``current``; a dead
    node's id is its replacement's)."""
    joining = tuple(sorted(set(joining)))
    live = set(current.live_nodes())
    if not joining or live & set(joining):
        raise PlanningError(f"joining nodes {list(joining)} must be new or dead nodes of the current plan "
                            f"(live: {sorted(live)})")
    profile, tp = planner.profile, planner.options.tp
    now = estimate_step(current, profile)
    redo = profile.rebuild_overhead_s + now.step_time_s  # rebuilt groups, and the step in flight redone
    options = [ActionOption("standby", Candidate(current.policy, current, now, reason=f"node(s) {list(joining)} wait"))]
    if current.failed:
        filled = fill_dead_places(current, joining)
        if filled is not None:
            plan, moved = filled
            transfers = schedule_transfers(current.holdings(), {n: plan.holdings()[n] for n in moved.values()},
                                           [u.state_bytes for u in profile.units()])
            options.append(ActionOption("fill", Candidate("reconfigure", plan, estimate_step(plan, profile), Transition(
                transfer_s=transfers.time_s(profile.transfer_bandwidth_Bps), overhead_s=redo), transfers,
                reason=f"node(s) {sorted(moved.values())} take the places of dead node(s) {sorted(moved)}")))
    total = len(live) + len(joining)
    shapes = planner.search_layouts(total, len(current.pipelines), max(1, round(len(current.nodes()) / len(current.pipelines))))

    def onto_all(shape: ExecutionPlan) -> tuple[ExecutionPlan, TransferSchedule]:
        plan, transfers = assign_nodes(current, shape, profile, joining)
        return ExecutionPlan("reconfigure", plan.num_layers, plan.pipelines,
                             reason=f"{len(plan.pipelines)} pipelines of lengths {[p.length for p in plan.pipelines]}"), transfers

    best = planner.best_reconfiguration(shapes, onto_all, redo, planner.options.mtbf_hours * 3600.0 / (total * tp))
    if best is not None:
        best.reason = f"reconfigure onto all {total} nodes: {best.reason}"
        options.append(ActionOption("reconfigure", best))
    for o in options:
        c = o.candidate
        if not c.step.fits_memory:
            c.reason += " (does not fit memory)"
            c.plan, c.step = None, None
            continue
        nodes = len(c.plan.live_nodes())
        c.restart_risk_s = planner.restart_risk_of(c.plan)
        c.score = score(planner.global_batch, c.step_time_s, c.transition.total_s,
                        planner.options.mtbf_hours * 3600.0 / (nodes * tp), c.restart_risk_s)
    feasible = [o for o in options if o.candidate.feasible]
    chosen = max(feasible, key=lambda o: (o.candidate.score, -JOIN_ACTIONS.index(o.action)))
    others = [o for o in feasible if o is not chosen]
    if chosen.action == "standby" and others:
        best = max(others, key=lambda o: o.candidate.score).candidate
        t_next = planner.options.mtbf_hours * 3600.0 / (len(live) * tp)
        chosen.candidate.reason = (
            f"node(s) {list(joining)} held as standby: {best.kind} onto them would run {best.step_time_s:.3g} s steps "
            f"instead of {chosen.candidate.step_time_s:.3g} s, which does not repay its {best.transition.total_s:.3g} s "
            f"transition in the {t_next:.3g} s to the next expected failure")
    return JoinDecision(chosen.action, chosen, options, joining)


def fill_dead_places(plan: ExecutionPlan, joining: tuple[int, ...]) -> tuple[ExecutionPlan, dict[int, int]] | None:
    """New nodes in dead nodes' places (a node rejoining under its own id takes its own place first, then the
    stage with most dead twins); the rest stays rerouted. Returns the plan and {dead node: new node}."""
    pos = plan.position_of()
    dead = [n for n in plan.failed if n in pos]
    if not dead:
        return None
    crowd: dict[frozenset[int], int] = {}
    for n in dead:
        crowd[plan.stage_units(*pos[n])] = crowd.get(plan.stage_units(*pos[n]), 0) + 1
    mapping = {n: n for n in joining if n in dead}
    rest = [n for n in joining if n not in mapping]
    free = sorted((n for n in dead if n not in mapping), key=lambda n: (-crowd[plan.stage_units(*pos[n])], pos[n]))
    mapping.update(zip(free, rest))
    pipes = tuple(Pipeline(tuple(Stage(mapping.get(s.node, s.node), s.layer_start, s.layer_end) for s in p.stages),
                           p.micro_batches) for p in plan.pipelines)
    remaining = frozenset(plan.failed) - set(mapping)
    base = ExecutionPlan("reconfigure", plan.num_layers, pipes, reason="dead places filled")
    if not remaining:
        return base, mapping
    rerouted = reroute_plan(base, remaining)
    if isinstance(rerouted, str):
        return None
    return ExecutionPlan("reconfigure", plan.num_layers, pipes, failed=remaining, reroutes=rerouted.reroutes,
                         reason="dead places filled, the rest rerouted", fill=plan.fill,
                         stagger=plan.stagger), mapping
