"""Reference curves that are not fault-tolerance systems: ``fault-scaled`` and ``ideal``.

``fault-scaled`` (ReCycle's evaluation): the fault-free job's throughput times the fraction of the
job's devices alive, with no transition cost. It is the customary yardstick but not a strict upper
bound: with a fixed global batch a smaller cluster runs more micro-batches per pipeline (fewer bubbles
per device), and ReCycle hides rerouted work in bubbles, so a policy can sit slightly above it.

``ideal``: every alive device busy all the time, no bubbles, no communication (the estimator's step
time of any layout on n nodes is at least M x W / n), so no policy can exceed it at any moment.
"""
from __future__ import annotations

from .base import KEEP, START, Policy, Reaction


class _Reference(Policy):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.alive: frozenset[int] = frozenset()
        self.started = False

    def nodes_in_use(self) -> frozenset[int]:
        return frozenset(sorted(self.alive)[: self.ctx.job_nodes]) if self.started else frozenset()

    @property
    def running(self) -> bool:
        return self.started

    def start(self, alive, full_launch):
        if not alive:
            return None
        self.alive, self.started = frozenset(alive), True
        return Reaction(START)

    def on_failure(self, removed, alive):
        self.alive = frozenset(alive)
        return KEEP

    def on_add(self, added, alive):
        self.alive = frozenset(alive)
        return KEEP

    def _fraction(self) -> float:
        return min(len(self.alive), self.ctx.job_nodes) / self.ctx.job_nodes


class FaultScaledPolicy(_Reference):
    name = "fault-scaled"

    def throughput(self) -> float:
        if not self.started:
            return 0.0
        memo = self.ctx.memo_of("fault-free")
        if "throughput" not in memo:
            memo["throughput"] = self.cost.throughput(self.ctx.initial_plan(list(range(self.ctx.job_nodes))))
        return memo["throughput"] * self._fraction()


class IdealPolicy(_Reference):
    name = "ideal"

    def throughput(self) -> float:
        if not self.started:
            return 0.0
        return self.cost.ideal_throughput(min(len(self.alive), self.ctx.job_nodes))
