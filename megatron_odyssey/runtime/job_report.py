"""What the job's JSON report (``--odyssey-report``) says about failures and takeovers, and how it is written.

The agent keeps one :class:`FailureRecord` per generation it started after a failure (and per takeover by the
standby): detection, decision, transfer and recovery times, the planner's candidates, how the failed ranks ended.
The report is rewritten after every failure and at the end; a reader never sees half of one.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .quorum import GONE

#: a record's bookkeeping, not the report's: clocks the report turns into durations, the takeover (listed apart)
_INTERNAL = ("started", "generation", "sealed_at", "published_at", "joined_at", "takeover")


@dataclass
class FailureRecord:
    """A generation the agent started after a failure, or after taking over from a lost agent: the report's entry."""

    ranks: list[int]
    phase: str = ""
    policy: str = ""
    fill: bool = False  # weight gradients deferred into pipeline bubbles (a filled reroute)
    stagger: bool = False  # ... with the staggered optimizer (ranks update before the commit)
    overlapped: list[int] = field(default_factory=list)  # --overlap-grad-reduce: ranks reducing inside the backward
    rolled_back: list[int] = field(default_factory=list)  # ranks that undid a step updated ahead of its commit
    kind: str = ""  # the policy with the filled and the normalised reroute told apart (Candidate.kind)
    detection_s: float = 0.0
    decision_s: float = 0.0
    transfer_s: float = 0.0
    recovery_s: float = 0.0
    step: int = -1
    reason: str = ""
    candidates: list[dict[str, Any]] = field(default_factory=list)
    cached: bool = False  # the decision came from the precomputed plan cache
    rebuild: dict[str, float] = field(default_factory=dict)  # slowest rank's world/groups/model time
    # rank -> the fraction of its stage's optimizer state it keeps (sharded optimizer: megatron_lm.replica_optimizer)
    optimizer_shares: dict[int, float] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)  # since the failure: sealed, published, first step
    error: dict[str, Any] | None = None  # a failed rank's own error (type, place, message, traceback)
    # rank -> how a failed rank's process ended when it left no error of its own ("was killed by SIGSEGV", "exited
    # with code 1", "was fenced (SIGKILL): missed heartbeats for 30.0 s"): a signal, a crash, an exception outside
    # Odyssey's reach (Megatron's fault injector's), or the agent's fence
    ended: dict[int, str] = field(default_factory=dict)
    time_to_next_failure_s: float = 0.0  # what Eq. 8 assumed (per-device MTBF / live devices)
    mtbf_hours: float = 0.0
    started: float = 0.0  # injection (or detection) time, for recovery_s
    sealed_at: float = 0.0
    published_at: float = 0.0
    joined_at: float = 0.0  # every survivor joined the new generation (its go)
    generation: int = 0
    lost_steps: int = 0  # committed steps a restart from a checkpoint trains again
    checkpoint_on_entry: bool = False  # the plan is fragile: its ranks checkpoint after its first step
    takeover: dict[str, Any] | None = None  # the standby took over from a lost agent (control_plane)
    dropped: str = ""  # the agent took these ranks out itself: why (a slow node the planner chose to drop)
    # the generation whose recovery began before this one's first step (a failure, a drop, a takeover meanwhile):
    # recovery_s then runs to that recovery's start, which its own record goes on from
    superseded_by: int = 0


def failure_entries(failures: list[FailureRecord], job_started: float) -> list[dict[str, Any]]:
    """The report's ``"failures"``: every failure record (a takeover that lost no rank is listed only as a
    takeover), with ``wall_s``, when the failure happened (injection, else detection), on the steps' clock."""
    return [{**{k: v for k, v in vars(f).items() if k not in _INTERNAL},
             "wall_s": f.started - job_started if f.started else None} for f in failures if f.ranks or not f.takeover]


def takeover_entries(failures: list[FailureRecord]) -> list[dict[str, Any]]:
    """The report's ``"takeovers"``: the standby agent going on from a lost one, and what it cost."""
    return [{"step": f.step, "generation": f.generation, "reason": f.takeover["reason"], "ranks_lost": f.ranks,
             "lost_as": f.takeover.get("lost_as", GONE),  # (runtime.quorum: "silent" needed half of the ranks)
             "policy": f.policy, "detection_s": f.detection_s, "recovery_s": f.recovery_s,
             "superseded_by": f.superseded_by}
            for f in failures if f.takeover]


def host_summary() -> dict[str, Any]:
    """What the ranks ran on, for reading the report's timings (several ranks may share few cores)."""
    import platform

    return {"hostname": platform.node(), "cpu_cores": len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity") else os.cpu_count()}


def write_report_file(path: Path, report: dict[str, Any]) -> None:
    """Written beside, then renamed over the last one: a reader never sees half a report."""
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(report, indent=1))
    partial.replace(path)
