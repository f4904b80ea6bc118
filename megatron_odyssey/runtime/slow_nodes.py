"""The agent's handling of what the diagnosis finds: each finding becomes a report entry and, for a slow node
or link, the planner's choice (``planning.slow.decide_slow``: carry on, rebalance, drop; readmit when it
recovers). The agent executes the actions: it fences a dropped node's ranks once every other rank is inside the
next step (``drop_gate``; then recovers as from any failure) and re-plans at a step boundary for a rebalance.
Hangs are named by the agent itself and only recorded here."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from ..planning.cluster import node_ranks
from ..planning.errors import PlanningError
from ..planning.plan import ExecutionPlan
from ..planning.planner import Planner
from ..planning.profile import ModelProfile
from ..planning.slow import SlowDecision, decide_slow
from .diagnosis import DiagnosisOptions, Diagnoser, Finding

ACTIONS = ("none", "rebalance", "drop", "readmit")


@dataclass
class DiagnosisRecord:
    """One entry of the report's ``"diagnoses"``."""

    step: int
    ranks: list[int]
    kind: str  # diagnosis.KINDS
    evidence: str
    action: str  # ACTIONS
    factor: float = 1.0
    detection_s: float | None = None  # from the injected slowdown (tests, demo) to this finding
    options: list[dict[str, Any]] = field(default_factory=list)  # decide_slow's options and their Eq. 8 scores
    reason: str = ""  # why that action (the chosen option)
    wall_s: float | None = None  # when it was named, on the report's clock (seconds since the ranks started)
    replan: Any = None  # the agent's record of the re-plan this action started (its timings)
    fenced: str = ""  # a drop: when its ranks were fenced, and why then (drop_gate)
    drop_wait_s: float | None = None  # a drop: from the decision to the fence

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> "DiagnosisRecord":
        """A report entry back as a record (a standby's copy of a drop that waits: not re-planned yet)."""
        names = {f.name for f in fields(cls)} - {"replan"}
        return cls(**{k: v for k, v in entry.items() if k in names})

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items() if k != "replan"}
        if self.replan is not None:
            out["generation"] = self.replan.generation
            out["recovery_s"] = self.replan.recovery_s or None
        return out


@dataclass
class Action:
    what: str  # "drop" (fence ``ranks``), "replan" (go to ``plan`` at the next step boundary) or "join" (admit
    #            the joining ``ranks`` into ``plan``, with ``transfers`` bringing them their state)
    record: Any  # the report entry it came from (DiagnosisRecord, joining.JoinRecord)
    ranks: list[int] = field(default_factory=list)
    plan: ExecutionPlan | None = None
    transfers: list[tuple[int, int, int]] = field(default_factory=list)


class SlowNodes:
    def __init__(self, tp: int, options: DiagnosisOptions | None = None, mode: str = "auto"):
        self.tp = tp
        self.diagnoser = Diagnoser(options)
        self.mode = mode  # auto (Eq. 8), a forced action (SLOW_ACTIONS) where feasible, or off
        self.on = mode != "off"
        self.records: list[DiagnosisRecord] = []
        self.slowdown: dict[int, float] = {}  # node -> factor the current plan was chosen for
        self.rebalanced: set[int] = set()  # nodes whose pipeline got fewer micro-batches

    def ranks_of(self, nodes: list[int]) -> list[int]:
        return node_ranks(nodes, self.tp)

    # -- the rank summaries ------------------------------------------------------------------------------
    @staticmethod
    def read(store: Any, prefix: str, members: list[int], step: int) -> dict[int, dict[str, Any]]:
        """Every member's record of ``step`` (one round trip when all have one). A rank overwrites its one key
        every step, so the store holds one record per rank; the agent reads before it commits ``step``, when
        no rank can have moved on to the next."""
        keys = [f"{prefix}/{i}" for i in members]
        if store.check(keys):
            pairs = list(zip(members, store.multi_get(keys)))
        else:
            pairs = [(i, store.get(k)) for i, k in zip(members, keys) if store.check([k])]
        out = {i: json.loads(v) for i, v in pairs}
        return {i: s for i, s in out.items() if s.get("step") == step}

    # -- after each commit -------------------------------------------------------------------------------
    def after_commit(self, step: int, summaries: dict[int, dict[str, Any]], plan: ExecutionPlan, planner: Planner,
                     profile: ModelProfile, slowed_at: Callable[[list[int]], float | None]) -> Action | None:
        """Diagnose ``step``; returns what the agent must do (at most one action per step)."""
        if not summaries:
            return None
        findings = self.diagnoser.observe(step, summaries, plan, profile)
        live = set(plan.live_nodes())
        action = None
        for finding in findings:
            nodes = [n for n in finding.nodes if n in live]
            if not nodes:
                continue
            factor = finding.factor if finding.kind == "slow" else self._link_factor(finding, summaries)
            record = DiagnosisRecord(step, self.ranks_of(nodes), finding.kind, finding.evidence, "none",
                                     round(finding.factor, 3))
            at = slowed_at(record.ranks)
            record.detection_s = round(time.time() - at, 3) if at is not None else None
            self.records.append(record)
            if action is None:  # one re-plan at a time: later findings are decided after it
                action = self._decide(record, plan, planner, {**self.slowdown, **{n: factor for n in nodes}})
        for kind, target in self.diagnoser.recoveries():
            if kind == "slow" and target in self.slowdown:
                del self.slowdown[target]
                if action is None and target in self.rebalanced:
                    action = self._readmit(step, target, plan, planner)
        return action

    def _decide(self, record: DiagnosisRecord, plan: ExecutionPlan, planner: Planner,
                slowdown: dict[int, float]) -> Action | None:
        try:
            decision = decide_slow(planner, plan, slowdown)
        except PlanningError as exc:
            record.reason = f"no decision: {exc}"
            return None
        self._force(decision)
        self._note(record, decision)
        self.slowdown = dict(decision.slowdown)
        if decision.action == "none":
            return None
        if decision.action == "drop":
            return Action("drop", record, ranks=record.ranks)
        self.rebalanced |= {n for n in decision.slowdown}
        return Action("replan", record, plan=decision.plan)

    def _readmit(self, step: int, node: int, plan: ExecutionPlan, planner: Planner) -> Action | None:
        """``node`` runs at full speed again: Eq. 8 on the plan without its slowdown."""
        record = DiagnosisRecord(step, self.ranks_of([node]), "slow", f"node {node}'s operations take as long as "
                                 f"its peers' again", "none", 1.0)
        self.records.append(record)
        self.rebalanced.discard(node)
        try:
            decision = decide_slow(planner, plan, self.slowdown)
        except PlanningError as exc:
            record.reason = f"no decision: {exc}"
            return None
        self._note(record, decision)
        if decision.action != "rebalance":
            return None
        record.action = "readmit"
        return Action("replan", record, plan=decision.plan)

    def _force(self, decision: SlowDecision) -> None:
        """``--slow-action`` other than auto: take that option when it can run (else Eq. 8's, and say so)."""
        if self.mode in ("auto", decision.action):
            return
        forced = next((o for o in decision.options if o.action == self.mode and o.candidate.feasible), None)
        if forced is not None:
            decision.action, decision.chosen = forced.action, forced
        else:
            decision.chosen.candidate.reason += f" (--slow-action {self.mode} is not possible here)"

    @staticmethod
    def _note(record: DiagnosisRecord, decision: SlowDecision) -> None:
        record.action = decision.action
        record.options = [o.summary() for o in decision.options]
        record.reason = decision.chosen.candidate.reason

    @staticmethod
    def _link_factor(finding: Finding, summaries: dict[int, dict[str, Any]]) -> float:
        """A slow link as the planner sees it: the source node's work per micro-batch lasts as long as its
        compute plus the link's delay per message."""
        src = finding.nodes[0]
        compute = [s["c"] for s in summaries.values() if int(s["node"]) == src and s["c"]]
        return 1.0 + finding.delay_s / compute[0] if compute and compute[0] > 0 else 1.0

    def hang(self, step: int, ranks: list[int], kind: str, evidence: str) -> None:
        """The agent fenced a hung rank (it then recovers as from a failure)."""
        self.records.append(DiagnosisRecord(step, ranks, kind, evidence, "drop"))
        for node in {r // self.tp for r in ranks}:
            self.diagnoser.forget(node)

    def left(self, nodes: set[int]) -> None:
        """Nodes that are out of the job (failed, dropped)."""
        for node in nodes:
            self.diagnoser.forget(node)
            self.slowdown.pop(node, None)
            self.rebalanced.discard(node)
