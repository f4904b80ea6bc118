"""Checkpoint-restart (Varuna-style job morphing): every failure of a node in use restarts the job
from the last checkpoint into the best symmetric (PP x DP) configuration of the survivors; when
nodes join and a larger grid pays back its restart before the expected next failure, it saves,
relaunches and loads (nothing lost). It does not detect fail-slow: a slow node slows its steps.
"""
from __future__ import annotations

from ...planning.plan import ExecutionPlan
from .base import KEEP, RESTART, START, STOP, Policy, Reaction


class CheckpointPolicy(Policy):
    name = "checkpoint"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.plan: ExecutionPlan | None = None
        self.stopped = False

    def throughput(self) -> float:
        return self.cost.throughput(self.plan, self.slowdown)

    def nodes_in_use(self) -> frozenset[int]:
        return frozenset(self.plan.nodes()) if self.plan else frozenset()

    @property
    def running(self) -> bool:
        return self.plan is not None

    def _grid(self, nodes: list[int]) -> ExecutionPlan | None:
        return self.cost.best_symmetric_plan(nodes)

    def start(self, alive, full_launch):
        nodes = self.pick(alive)
        plan = self.ctx.initial_plan(nodes) if full_launch else self._grid(nodes)
        if plan is None:
            return None
        self.plan = plan
        kind, cost = (RESTART, self.ctx.restart_s) if self.stopped else (START, 0.0)
        self.stopped = False
        return Reaction(kind, cost, note="launch")

    def on_failure(self, removed, alive):
        assert self.plan is not None
        if not frozenset(removed) & self.nodes_in_use():
            return KEEP
        self.plan = self._grid(self.pick(alive))
        if self.plan is None:
            self.stopped = True
            return Reaction(STOP, 0.0, lose_since_checkpoint=True, note="no symmetric layout fits the survivors")
        return Reaction(RESTART, self.ctx.restart_s, lose_since_checkpoint=True, note="restart from checkpoint")

    def on_add(self, added, alive):
        if self.plan is None:
            return self.start(alive, False) or KEEP
        if not self.spare(alive):
            return KEEP
        nodes = self.pick(alive)
        bigger = self._grid(nodes)
        if bigger is None or not self.ctx.worth_growing(self.cost.throughput(self.plan), self.cost.throughput(bigger),
                                                         self.ctx.voluntary_restart_s, len(nodes)):
            return KEEP
        self.plan = bigger
        return Reaction(RESTART, self.ctx.voluntary_restart_s, saves_checkpoint=True, note="grow: save and relaunch")
