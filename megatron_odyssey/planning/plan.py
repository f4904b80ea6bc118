"""Execution plans: who holds which layers, who runs which micro-batches.

A plan is a list of pipelines. Each pipeline is a list of stages, each stage one node holding a
contiguous range of transformer layers (the first stage also holds the embedding, the last the
output layer). Pipeline ``k`` processes global micro-batches ``offset_k .. offset_k + m_k - 1`` of
every step, in pipeline order, so the global batch is the same whatever the plan.

A *rerouted* plan keeps the layout of the plan it came from, including the dead nodes, and adds a
rerouting table: the micro-batch ``j`` of pipeline ``k`` at a dead stage runs on ``peer``, a live
node holding exactly the same layers (ReCycle). Activations come from the dead node's pipeline
predecessor and go to its successor.

Weight-holding *units* are numbered in model order: 0 = embedding, 1..L = transformer layers
0..L-1, L+1 = output layer.
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Iterable

from .errors import PlanningError

PLAN_SCHEMA_VERSION = 1
POLICIES = ("initial", "reroute", "reconfigure", "restart")


@functools.lru_cache(maxsize=4096)
def _units(layer_start: int, layer_end: int, first: bool, last: bool, num_layers: int) -> frozenset[int]:
    """A stage's units (a big cluster has thousands of stages but only a few distinct ones)."""
    units = set(range(layer_start + 1, layer_end + 1))
    if first:
        units.add(0)
    if last:
        units.add(num_layers + 1)
    return frozenset(units)


def layer_range(start: int, end: int) -> str:
    """``[0,6)``: layer ranges are half-open everywhere, in tables, messages and JSON (``"layers": [0, 6]``
    holds layers 0..5), so a range reads the same wherever it is printed."""
    return f"[{start},{end})"


@dataclass(frozen=True)
class Stage:
    node: int
    layer_start: int
    layer_end: int  # exclusive

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def layers_text(self) -> str:
        return layer_range(self.layer_start, self.layer_end)


@dataclass(frozen=True)
class Pipeline:
    stages: tuple[Stage, ...]
    micro_batches: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))

    @property
    def length(self) -> int:
        return len(self.stages)

    def layer_split(self) -> tuple[int, ...]:
        return tuple(s.num_layers for s in self.stages)


@dataclass(frozen=True)
class Reroute:
    pipeline: int
    stage: int
    micro_batch: int  # index within the pipeline, 0..micro_batches-1
    peer: int  # live node that runs it


@dataclass(frozen=True)
class ExecutionPlan:
    policy: str
    num_layers: int
    pipelines: tuple[Pipeline, ...]
    failed: frozenset[int] = field(default_factory=frozenset)  # dead nodes still named in the layout
    reroutes: tuple[Reroute, ...] = ()
    reason: str = ""
    schema_version: int = PLAN_SCHEMA_VERSION
    # rerouted plans only: ReCycle's bubble filling. Backward ops of the pipelines that a reroute
    # couples (the dead node's and its peers') split into input-gradient (B) and weight-gradient
    # (W) halves, W deferred into idle slots or the end of the step (``schedule.filled_schedule``)
    fill: bool = False
    # filled plans only: ReCycle's staggered optimizer. Each rank applies its update as soon as its own
    # gradients are synchronised, before the agent commits the step, keeping its pre-update state until
    # the commit (rolled back if the step is not committed), so the W's a late node defers overlap the
    # next step's warm-up instead of holding every stage back (runtime.generation)
    stagger: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "pipelines", tuple(self.pipelines))
        object.__setattr__(self, "failed", frozenset(self.failed))
        object.__setattr__(self, "reroutes", tuple(self.reroutes))
        if self.policy not in POLICIES:
            raise PlanningError(f"unknown policy {self.policy!r}; expected one of {POLICIES}")

    # -- derived views (a plan is immutable: the costly ones are computed once; the agent asks every step) --
    @functools.cached_property
    def plan_id(self) -> str:
        """Stable short id of the layout and routing, for logs and reports."""
        digest = hashlib.sha1(json.dumps(self.to_dict(include_id=False), sort_keys=True).encode())
        return digest.hexdigest()[:10]

    @property
    def num_micro_batches(self) -> int:
        return sum(p.micro_batches for p in self.pipelines)

    def micro_batch_offsets(self) -> list[int]:
        offsets, total = [], 0
        for p in self.pipelines:
            offsets.append(total)
            total += p.micro_batches
        return offsets

    def nodes(self) -> list[int]:
        """Every node named in the layout, dead ones included."""
        return [s.node for p in self.pipelines for s in p.stages]

    def live_nodes(self) -> list[int]:
        return list(self._live_nodes)

    @functools.cached_property
    def _live_nodes(self) -> tuple[int, ...]:
        return tuple(sorted(n for n in self.nodes() if n not in self.failed))

    def stage_units(self, pipeline: int, stage: int) -> frozenset[int]:
        p = self.pipelines[pipeline]
        s = p.stages[stage]
        return _units(s.layer_start, s.layer_end, stage == 0, stage == p.length - 1, self.num_layers)

    def position_of(self) -> dict[int, tuple[int, int]]:
        """node -> (pipeline, stage) for every node named in the layout."""
        return dict(self._position_of)

    @functools.cached_property
    def _position_of(self) -> dict[int, tuple[int, int]]:
        return {s.node: (k, i) for k, p in enumerate(self.pipelines) for i, s in enumerate(p.stages)}

    def holdings(self) -> dict[int, frozenset[int]]:
        """Units held by each *live* node."""
        return dict(self._holdings)

    @functools.cached_property
    def _holdings(self) -> dict[int, frozenset[int]]:
        pos = self._position_of
        return {n: self.stage_units(*pos[n]) for n in self._live_nodes}

    def holders(self) -> dict[int, list[int]]:
        """unit -> live nodes holding it (the gradient-sync group of that unit)."""
        return {u: list(nodes) for u, nodes in self._holders.items()}

    @functools.cached_property
    def _holders(self) -> dict[int, tuple[int, ...]]:
        out: dict[int, list[int]] = {u: [] for u in range(self.num_layers + 2)}
        for node, units in sorted(self._holdings.items()):
            for u in units:
                out[u].append(node)
        return {u: tuple(nodes) for u, nodes in out.items()}

    def executor(self) -> dict[tuple[int, int, int], int]:
        """(pipeline, stage, micro-batch) -> node that runs it, for rerouted work only."""
        return {(r.pipeline, r.stage, r.micro_batch): r.peer for r in self.reroutes}

    # -- validation ---------------------------------------------------------------------------
    def validate(self, num_micro_batches: int | None = None, valid_nodes: Iterable[int] | None = None) -> None:
        """Reject a plan that cannot run, with the reason (before any process starts)."""
        if not self.pipelines:
            raise PlanningError("plan has no pipelines")
        seen: dict[int, tuple[int, int]] = {}
        valid = set(valid_nodes) if valid_nodes is not None else None
        for k, p in enumerate(self.pipelines):
            if p.micro_batches < 1:
                raise PlanningError(f"pipeline {k} has {p.micro_batches} micro-batches; every pipeline needs at least one")
            if not p.stages:
                raise PlanningError(f"pipeline {k} has no stages")
            expect = 0
            for i, s in enumerate(p.stages):
                if s.layer_start != expect or s.layer_end <= s.layer_start:
                    raise PlanningError(
                        f"pipeline {k} stage {i} holds layers {s.layers_text} but must start at "
                        f"layer {expect} and hold at least one: stages must cover every layer exactly once, in order")
                expect = s.layer_end
                if s.node in seen:
                    raise PlanningError(f"node {s.node} appears twice (pipeline {seen[s.node][0]} stage "
                                        f"{seen[s.node][1]} and pipeline {k} stage {i})")
                if valid is not None and s.node not in valid:
                    raise PlanningError(f"pipeline {k} stage {i} names node {s.node}, which does not exist; "
                                        f"valid nodes are {sorted(valid)}")
                seen[s.node] = (k, i)
            if expect != self.num_layers:
                raise PlanningError(f"pipeline {k} covers layers {layer_range(0, expect)} but the model has "
                                    f"{self.num_layers}")
        if num_micro_batches is not None and self.num_micro_batches != num_micro_batches:
            raise PlanningError(f"plan runs {self.num_micro_batches} micro-batches per step, "
                                f"the global batch has {num_micro_batches}")
        self._validate_reroutes(seen)
        if self.fill and not self.reroutes:
            raise PlanningError("fill (bubble-filling backward) applies to rerouted plans only; this plan reroutes nothing")
        if self.stagger and not self.fill:
            raise PlanningError("stagger (the staggered optimizer) applies to filled plans only; this plan does not fill")

    def _validate_reroutes(self, position: dict[int, tuple[int, int]]) -> None:
        table = self.executor()
        if len(table) != len(self.reroutes):
            raise PlanningError("rerouting table lists the same (pipeline, stage, micro-batch) twice")
        for k, p in enumerate(self.pipelines):
            for i, s in enumerate(p.stages):
                if s.node not in self.failed:
                    continue
                mine = self.stage_units(k, i)
                for j in range(p.micro_batches):
                    peer = table.get((k, i, j))
                    if peer is None:
                        raise PlanningError(f"micro-batch {j} of pipeline {k} at stage {i} (dead node {s.node}) "
                                            "has no peer to run it")
                    if peer in self.failed or peer not in position:
                        raise PlanningError(f"peer {peer} for dead node {s.node} is not a live node of the plan")
                    if self.stage_units(*position[peer]) != mine:
                        raise PlanningError(f"peer {peer} does not hold the same layers as dead node {s.node}")
        for r in self.reroutes:
            k, i = r.pipeline, r.stage
            if not (0 <= k < len(self.pipelines) and 0 <= i < self.pipelines[k].length):
                raise PlanningError(f"reroute names pipeline {k} stage {i}, which is not in the plan")
            if self.pipelines[k].stages[i].node not in self.failed:
                raise PlanningError(f"reroute moves work of live node {self.pipelines[k].stages[i].node}")

    # -- JSON ---------------------------------------------------------------------------------
    def to_dict(self, include_id: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema_version": self.schema_version,
            "policy": self.policy,
            "num_layers": self.num_layers,
            "pipelines": [
                {"micro_batches": p.micro_batches,
                 "stages": [{"node": s.node, "layers": [s.layer_start, s.layer_end]} for s in p.stages]}
                for p in self.pipelines
            ],
            "failed": sorted(self.failed),
            "reroutes": [[r.pipeline, r.stage, r.micro_batch, r.peer] for r in self.reroutes],
            "reason": self.reason,
        }
        if self.fill:  # only when set: ids of unfilled plans stay what they were
            out["fill"] = True
        if self.stagger:
            out["stagger"] = True
        if include_id:
            out["plan_id"] = self.plan_id
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ExecutionPlan":
        version = data.get("schema_version")
        if version != PLAN_SCHEMA_VERSION:
            raise PlanningError(f"plan schema_version {version!r} is not supported (expected {PLAN_SCHEMA_VERSION})")
        try:
            pipelines = tuple(
                Pipeline(tuple(Stage(int(s["node"]), int(s["layers"][0]), int(s["layers"][1])) for s in p["stages"]),
                         int(p["micro_batches"]))
                for p in data["pipelines"])
            return cls(policy=data["policy"], num_layers=int(data["num_layers"]), pipelines=pipelines,
                       failed=frozenset(data.get("failed", ())),
                       reroutes=tuple(Reroute(*map(int, r)) for r in data.get("reroutes", ())),
                       reason=data.get("reason", ""), fill=bool(data.get("fill", False)),
                       stagger=bool(data.get("stagger", False)))
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise PlanningError(f"malformed plan JSON: {exc!r}") from None


def symmetric_plan(pp: int, dp: int, num_layers: int, num_micro_batches: int,
                   layer_split: tuple[int, ...] | None = None) -> ExecutionPlan:
    """Megatron's fault-free layout: DP identical pipelines, node of (stage s, replica d) = s*DP + d."""
    if num_micro_batches % dp:
        raise PlanningError(f"{num_micro_batches} micro-batches cannot be split evenly over DP={dp}")
    split = layer_split or even_split(num_layers, pp)
    bounds = [0]
    for n in split:
        bounds.append(bounds[-1] + n)
    pipes = tuple(
        Pipeline(tuple(Stage(s * dp + d, bounds[s], bounds[s + 1]) for s in range(pp)), num_micro_batches // dp)
        for d in range(dp))
    return ExecutionPlan("initial", num_layers, pipes)


def even_split(num_layers: int, stages: int) -> tuple[int, ...]:
    """Megatron's uniform split; when ``num_layers`` does not divide, the last stages take one extra.

    Callers that care about balance (embedding and output cost) use ``planning.layers.split_layers``.
    """
    base, extra = divmod(num_layers, stages)
    return tuple(base + (1 if i >= stages - extra else 0) for i in range(stages))


def layout(pipelines_shape: list[tuple[tuple[int, ...], int]], nodes: list[int] | None = None,
           num_layers: int | None = None, policy: str = "reconfigure") -> ExecutionPlan:
    """Build a plan from [(layer split, micro-batches)], assigning nodes in order (or 0..N-1)."""
    total = sum(len(split) for split, _ in pipelines_shape)
    nodes = list(range(total)) if nodes is None else list(nodes)
    if len(nodes) != total:
        raise PlanningError(f"layout needs {total} nodes, got {len(nodes)}")
    it = iter(nodes)
    pipes = []
    for split, mbs in pipelines_shape:
        start, stages = 0, []
        for n in split:
            stages.append(Stage(next(it), start, start + n))
            start += n
        pipes.append(Pipeline(tuple(stages), mbs))
    L = num_layers if num_layers is not None else sum(pipelines_shape[0][0])
    return ExecutionPlan(policy, L, tuple(pipes))
