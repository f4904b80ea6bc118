"""ReCycle (Gandhi et al., SOSP '24): always reroute; never move weights except to rebalance.

* A failed worker's micro-batches run on its data-parallel peers of the same stage; the adaptive
  schedule (decoupled back-propagation, staggered optimizer) hides them in pipeline bubbles as far as
  they fit (``normalisation.adaptive_compute_time``). With ``bubble_filling=False`` (policy
  ``recycle-nofill``) the step time is instead the planning estimator's play of the rerouted 1F1B
  schedule, i.e. rerouting as the Odyssey paper models it (Eq. 12/13).
* Failure normalisation (slides' Algorithm 1) places the failures over stages; surviving workers
  change stage when that lowers the step time (they fetch the new stage's parameters from a peer).
* A stage that loses every replica cannot be rerouted: restart from the last checkpoint into the
  best symmetric configuration of the survivors.
* A node that joins takes a dead worker's place (ReCycle handles re-joins; it fetches its stage's
  parameters from a peer while training continues, then the groups are rebuilt). With no place left
  to fill, extra nodes can only be used by a restart into a larger grid, which we do (after saving)
  when that pays back before the expected next failure (``SimContext.worth_growing``).
* ReCycle does not detect fail-slow: a slow node slows the steps it takes part in (its throughput is the
  play with the slow nodes' factors; its decisions see nominal speeds).
"""
from __future__ import annotations

import math
from dataclasses import replace

from ...planning.plan import ExecutionPlan, Pipeline, Stage
from ...planning.planner import reroute_plan
from ...planning.normalise import normalised_grid
from ..normalisation import adaptive_compute_time
from .base import FILL, KEEP, REROUTE, RESTART, START, STOP, Policy, Reaction, then


class RecyclePolicy(Policy):
    name = "recycle"

    def __init__(self, ctx, bubble_filling: bool = True, staggered: bool = True):
        super().__init__(ctx)
        self.bubble_filling = bubble_filling
        self.staggered = staggered
        if not bubble_filling:
            self.name = "recycle-nofill"
        elif not staggered:
            self.name = "recycle-nostagger"
        self.grid: ExecutionPlan | None = None  # the layout, dead nodes still in place
        self.failed: frozenset[int] = frozenset()
        self.stopped = False
        self._step_memo = ctx.memo_of(f"{self.name}.step")

    # -- geometry ----------------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        return len(self.grid.pipelines)

    @property
    def pp(self) -> int:
        return self.grid.pipelines[0].length

    @property
    def mb(self) -> int:
        return self.grid.pipelines[0].micro_batches

    def _counts(self, grid: ExecutionPlan, failed: frozenset[int]) -> list[int]:
        return [sum(1 for p in grid.pipelines if p.stages[s].node in failed) for s in range(grid.pipelines[0].length)]

    # -- engine view -------------------------------------------------------------------------------
    def throughput(self) -> float:
        return self._throughput(self.slowdown)

    def _throughput(self, slowdown: dict[int, float] | None = None) -> float:
        if self.grid is None:
            return 0.0
        t = self._step(self.grid, self.failed, slowdown)
        return self.cost.samples_per_step / t if math.isfinite(t) and t > 0 else 0.0

    def nodes_in_use(self) -> frozenset[int]:
        if self.grid is None:
            return frozenset()
        return frozenset(self.grid.nodes()) - self.failed

    @property
    def running(self) -> bool:
        return self.grid is not None

    def _step(self, grid: ExecutionPlan, failed: frozenset[int], slowdown: dict[int, float] | None = None) -> float:
        """Step time of ``grid`` with ``failed`` nodes rerouted; ``slowdown``: fail-slow nodes' factors (the
        closed-form model has no per-node speeds, so with slow nodes the play is used)."""
        plain = ExecutionPlan(grid.policy, grid.num_layers, grid.pipelines)
        if not failed:
            return self.cost.step_time(plain, slowdown=slowdown)
        if self.bubble_filling and (self.ctx.config.recycle_model == "play" or slowdown):
            rerouted = reroute_plan(plain, failed)
            if not isinstance(rerouted, ExecutionPlan):
                return math.inf
            return self.cost.step_time(replace(rerouted, fill=True), staggered=self.staggered, slowdown=slowdown)
        if self.bubble_filling:
            counts = tuple(self._counts(grid, failed))
            split, mb = grid.pipelines[0].layer_split(), grid.pipelines[0].micro_batches
            key = (split, mb, len(grid.pipelines), counts)
            hit = self._step_memo.get(key)
            if hit is None:
                model = self.cost.model
                ff_compute = model.time(split, mb)
                overhead = self.cost.step_time(plain) - ff_compute  # gradient sync + optimizer
                compute = adaptive_compute_time(model.stage_costs(split), counts, len(grid.pipelines), mb,
                                                ff_compute, self.ctx.config.recycle_residual_bubble)
                hit = self._step_memo[key] = compute + overhead
            return hit
        rerouted = reroute_plan(plain, failed)
        return self.cost.step_time(rerouted, slowdown=slowdown) if isinstance(rerouted, ExecutionPlan) else math.inf

    # -- reactions ---------------------------------------------------------------------------------
    def start(self, alive, full_launch):
        nodes = self.pick(alive)
        grid = self.ctx.initial_plan(nodes) if full_launch else self._best_grid(nodes)
        if grid is None:
            return None
        self.grid, self.failed = grid, frozenset()
        kind, cost = (RESTART, self.ctx.restart_s) if self.stopped else (START, 0.0)
        self.stopped = False
        return Reaction(kind, cost, note=f"grid PP={self.pp} x DP={self.dp}")

    def _best_grid(self, nodes: list[int]) -> ExecutionPlan | None:
        return self.cost.best_symmetric_plan(nodes)

    def on_failure(self, removed, alive):
        assert self.grid is not None
        hit = frozenset(removed) & self.nodes_in_use()
        if not hit:
            return KEEP
        failed = self.failed | hit
        counts = self._counts(self.grid, failed)
        if max(counts) >= self.dp:
            return self._restart(alive, lose=True, why=f"a stage lost every replica ({counts})")
        self.failed = failed
        reaction = Reaction(REROUTE, self.ctx.profile.reroute_overhead_s, note=f"failures per stage {counts}")
        reaction = then(reaction, self._normalise())
        return then(reaction, self.on_add(frozenset(), alive))

    def _normalise(self) -> Reaction:
        """Move surviving workers between stages to the normalised failure placement if it is faster."""
        grid, failed = self.grid, self.failed
        out = normalised_grid(grid, failed)
        if out is None:
            return KEEP
        moved, targets = out
        counts, target = self._counts(grid, failed), self._counts(moved, failed)
        before, after = self._step(grid, failed), self._step(moved, failed)
        if (after, max(target)) >= (before, max(counts)):
            return KEEP
        self.grid = moved
        holdings = {n: grid.stage_units(*pos) for n, pos in grid.position_of().items() if n not in failed}
        copy_s = self.cost.transfer_time(holdings, targets)
        return Reaction(REROUTE, copy_s, note=f"failure normalisation {counts} -> {target}")

    def _restart(self, alive, lose: bool, why: str, voluntary: bool = False) -> Reaction:
        grid = self._best_grid(self.pick(alive))
        if grid is None:
            self.grid, self.failed, self.stopped = None, frozenset(), True
            return Reaction(STOP, 0.0, lose_since_checkpoint=lose, saves_checkpoint=not lose, note=why)
        self.grid, self.failed = grid, frozenset()
        cost = self.ctx.voluntary_restart_s if voluntary else self.ctx.restart_s
        return Reaction(RESTART, cost, lose_since_checkpoint=lose, saves_checkpoint=voluntary,
                        note=f"{why}; restart as PP={self.pp} x DP={self.dp}")

    def on_add(self, added, alive):
        if self.grid is None:
            return self.start(alive, False) or KEEP
        spare = self.spare(alive)
        if not spare:
            return KEEP
        reaction = KEEP
        if self.failed:
            counts = self._counts(self.grid, self.failed)
            pos = {p.stages[s].node: (s, d) for d, p in enumerate(self.grid.pipelines) for s in range(self.pp)}
            dead = sorted(self.failed, key=lambda n: (-counts[pos[n][0]], pos[n]))
            mapping = dict(zip(dead, spare))
            pipes = tuple(Pipeline(tuple(Stage(mapping.get(st.node, st.node), st.layer_start, st.layer_end)
                                         for st in p.stages), p.micro_batches) for p in self.grid.pipelines)
            self.grid = ExecutionPlan(self.grid.policy, self.grid.num_layers, pipes)
            self.failed = self.failed - set(mapping)
            reaction = Reaction(FILL, self.ctx.profile.reroute_overhead_s, note=f"{len(mapping)} node(s) rejoin")
            spare = spare[len(mapping):]
        if spare and not self.failed:
            n = len(self.nodes_in_use()) + len(spare)
            bigger = self.cost.best_symmetric_plan(list(range(n)))
            if bigger is not None:
                if self.ctx.worth_growing(self._throughput(), self.cost.throughput(bigger),
                                                                 self.ctx.voluntary_restart_s, n):
                    return then(reaction, self._restart(alive, lose=False, why="grow", voluntary=True))
        return reaction
