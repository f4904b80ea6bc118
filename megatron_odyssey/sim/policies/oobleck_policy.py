"""Oobleck (Jang et al., SOSP '23) on top of ``sim/oobleck.py`` (templates §4.1.1, instantiation and
batch distribution §4.2, reinstantiation §5.1, redistribution §5.2, add_nodes).

* Templates are generated once for the job's N nodes with threshold f (``oobleck_f``) and the smallest
  n0 whose pipeline holds the model in memory (§4.1.1); each template's GPU-stage mapping and pipeline
  time (§4.1.2) come from ``sim/templates.py`` (per-layer costs of the same profile), and the pipelines
  Oobleck instantiates are then timed by the planning estimator, like every policy's.
* The job starts as the configured grid (DP pipelines of PP nodes, an instantiation from the
  PP-node template), so all policies share the fault-free throughput.
* Every reconfiguration copies the layers a node lacks from live replicas (bytes / transfer
  bandwidth, links in parallel) and pays the rebuild overhead; step times of the resulting
  heterogeneous pipelines come from the estimator (per-layer gradient sync rounds included).
* Below (f+1) * n0 nodes Oobleck stores its progress and exits (§3.4); throughput is 0 until enough
  nodes are back, then it restarts from that checkpoint. If some layer lost every replica it restarts
  from the last periodic checkpoint instead (§3.2).
"""
from __future__ import annotations

import math

from ...planning.plan import ExecutionPlan, Pipeline, Stage
from .. import oobleck as ob
from ..costmodel import lost_units
from ..errors import SimulationError
from ..templates import TemplateModel
from .base import KEEP, RECONFIGURE, RESTART, START, STOP, Policy, Reaction, then

_INFEASIBLE_S = 1e9  # sim/oobleck.py needs finite pipeline times; a pipeline that does not fit is "never"


def oobleck_config(ctx) -> ob.OobleckConfig:
    memo = ctx.memo_of("oobleck.config")
    if "cfg" not in memo:
        c = ctx.config
        model = ctx.cost.templates
        memo["templates"] = model
        n0 = model.min_nodes()
        if n0 is None:
            raise SimulationError("--policies oobleck: no pipeline of any length holds the model in memory, "
                                  "so Oobleck has no pipeline template")
        n0 = min(n0, c.pp)
        if ctx.job_nodes < (c.oobleck_f + 1) * n0:
            raise SimulationError(f"--policies oobleck needs (f+1) x {n0} = {(c.oobleck_f + 1) * n0} nodes to keep f+1 "
                                  f"pipelines (f={c.oobleck_f}, {n0} nodes hold one model replica); the job has "
                                  f"{ctx.job_nodes}: raise --dp, or leave oobleck out of --policies")
        def pipeline_time(n: int, m: int) -> float:
            t = model.pipeline_time(n, m)
            return t if math.isfinite(t) else _INFEASIBLE_S

        memo["cfg"] = ob.OobleckConfig(ctx.job_nodes, c.oobleck_f, n0, c.num_micro_batches, pipeline_time)
    return memo["cfg"]


class OobleckPolicy(Policy):
    name = "oobleck"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.cfg = oobleck_config(ctx)
        self.templates: TemplateModel = ctx.memo_of("oobleck.config")["templates"]
        own = ctx.config.oobleck_rebuild_s
        self.rebuild_s = ctx.profile.rebuild_overhead_s if own is None else own
        self.inst: ob.Instantiation | None = None
        self.plan: ExecutionPlan | None = None
        self.stopped = False
        self._plan_memo = ctx.memo_of("oobleck.plan")
        self._reinst_memo = ctx.memo_of("oobleck.reinstantiate")

    # -- engine view -------------------------------------------------------------------------------
    def throughput(self) -> float:
        """Oobleck does not detect fail-slow: its plan is played with the cluster's slow nodes."""
        return self.cost.throughput(self.plan, self.slowdown)

    def nodes_in_use(self) -> frozenset[int]:
        return frozenset(self.inst.active_nodes) if self.inst else frozenset()

    @property
    def running(self) -> bool:
        return self.inst is not None

    def _to_plan(self, inst: ob.Instantiation) -> ExecutionPlan:
        plan = self._plan_memo.get(inst)
        if plan is None:
            L = self.ctx.profile.num_layers
            pipes = []
            for p in inst.pipelines:
                template = self.templates.template(p.num_nodes)
                split = template[0] if template is not None else _even(L, p.num_nodes)
                start, stages = 0, []
                for node, n in zip(p.nodes, split):
                    stages.append(Stage(node, start, start + n))
                    start += n
                pipes.append(Pipeline(tuple(stages), p.num_microbatches))
            plan = self._plan_memo[inst] = ExecutionPlan("reconfigure", L, tuple(pipes))
        return plan

    def _set(self, inst: ob.Instantiation | None) -> float:
        """Adopt ``inst``; returns the time to copy missing layers into it."""
        old = self.plan
        self.inst = inst
        self.plan = self._to_plan(inst) if inst is not None else None
        if old is None or self.plan is None:
            return 0.0
        present = set(inst.all_nodes)  # survivors, including idle ones; failed nodes are gone
        holdings = {n: u for n, u in old.holdings().items() if n in present}
        for n in inst.active_nodes:
            holdings.setdefault(n, frozenset())
        return self.cost.transfer_time(holdings, self.plan.holdings())

    # -- reactions ---------------------------------------------------------------------------------
    def start(self, alive, full_launch):
        nodes = self.pick(alive)
        if len(nodes) < self.cfg.min_feasible_nodes:
            return None
        self.plan = None
        if full_launch:
            # the launched grid: DP pipelines of the PP-node template, laid out exactly as every policy's
            c = self.ctx.config
            groups = [[nodes[s * c.dp + d] for s in range(c.pp)] for d in range(c.dp)]
            self.inst = ob.build_instantiation(self.cfg, groups)
            self.plan = self.ctx.initial_plan(nodes)
            inst = self.inst
        else:
            inst = ob.instantiate(self.cfg, len(nodes), nodes)
            self._set(inst)
        kind, cost = (RESTART, self.ctx.restart_s) if self.stopped else (START, 0.0)
        self.stopped = False
        return Reaction(kind, cost, note=f"pipelines {list(inst.node_counts)}")

    def _stop(self, lose: bool, why: str) -> Reaction:
        self.inst, self.plan, self.stopped = None, None, True
        return Reaction(STOP, 0.0, lose_since_checkpoint=lose, saves_checkpoint=not lose, note=why)

    def on_failure(self, removed, alive):
        assert self.inst is not None and self.plan is not None
        hit = frozenset(removed) & frozenset(self.inst.all_nodes)
        if not hit:
            return KEEP
        if lost_units(self.plan, hit):
            # §3.2: no live copy of some layer -> restart from the last checkpoint if enough nodes remain
            nodes = self.pick(alive)
            if len(nodes) < self.cfg.min_feasible_nodes:
                return self._stop(True, "a layer lost every replica and too few nodes remain")
            self.plan = None
            self._set(ob.instantiate(self.cfg, len(nodes), nodes))
            return Reaction(RESTART, self.ctx.restart_s, lose_since_checkpoint=True,
                            note="a layer lost every replica: restart from checkpoint")
        key = (self.inst, hit)
        new = self._reinst_memo.get(key, False)
        if new is False:
            new = self._reinst_memo[key] = ob.reinstantiate(self.cfg, self.inst, failed_nodes=hit)
        if new is None:
            return self._stop(False, f"fewer than (f+1)*n0 = {self.cfg.min_feasible_nodes} nodes: store progress and exit")
        copy_s = self._set(new)
        reaction = Reaction(RECONFIGURE, copy_s + self.rebuild_s,
                            note=f"reinstantiated as {list(new.node_counts)}")
        return then(reaction, self.on_add(frozenset(), alive))

    def on_add(self, added, alive):
        if self.inst is None:
            return self.start(alive, False) or KEEP
        spare = self.spare(alive)
        if not spare:
            return KEEP
        new = ob.add_nodes(self.cfg, self.inst, spare)
        copy_s = self._set(new)
        return Reaction(RECONFIGURE, copy_s + self.rebuild_s,
                        note=f"{len(spare)} node(s) added: {list(new.node_counts)}")


def _even(num_layers: int, stages: int) -> tuple[int, ...]:
    base, extra = divmod(num_layers, stages)
    return tuple(base + (1 if i >= stages - extra else 0) for i in range(stages))
