"""A node whose rank left the job stuck in a collective, or was fenced while its machine stood still, is started
again, and joins the running job.

A rank leaves as ``StuckInCollective`` (:mod:`.stuck_call`) when gloo holds its main thread in a call that no
connection can end any more: its process is stuck, its machine and its device are not. A job without spare nodes
would lose a healthy node for the rest of its run, so the node's launcher starts its ranks again, the way a machine
that comes back joins (``odyssey-launch --join``: a private world, then a join request that the planner admits at an
iteration boundary, ``planning.join``, Eq. 8: fill the dead place, reconfigure onto it, or hold it as a standby).

A node (its tensor-parallel ranks) comes back whole, once every rank of it has exited in this life: at least one
stuck, the others stuck too or with exit code 0 (a rank leaves with 0 when the generation it is told to enter has no
place for its node). A node where any rank ended otherwise (killed, by a signal, with its own error) is not started
again: that is the failure the job recovers from, and a process that crashed may have crashed for a reason a new one
would meet again.

The same holds for ranks the agent fenced, for their silence, while their machine stood still whole (a VM its host
paused, a hung kernel; ``runtime.pause_clock`` sees it from inside when the machine goes on): nothing of theirs broke,
and their launcher, stopped with them, finds the fence once it runs again. A node is started again at most ``limit``
times in all (``odyssey-launch --stuck-restarts``): one stuck or stopped again and again has something wrong with it
that a new process does not mend. No torch here (the launcher's import stays fast).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .errors import LOCAL_ERROR_EXIT, STOPPED_EXIT, STUCK_TYPE, ErrorRecord, read_error

MAX_RESTARTS = 2  # odyssey-launch --stuck-restarts' default


def record_times(store: Any, ranks: Iterable[int]) -> dict[int, float | None]:
    """Each rank's error record in the store now, by its time (None: none): what a life that starts now must not take
    for its own (:attr:`StuckRestarts.before`)."""
    return {ident: getattr(read_error(store, ident), "time", None) for ident in ranks}


@dataclass
class NodeToRestart:
    node: int
    ranks: list[int]
    stuck: dict[int, ErrorRecord]  # the ranks that left stuck, with their records
    time: int  # which restart this is (1 for the first)
    paused: dict[int, float] = field(default_factory=dict)  # ranks fenced while this machine stood still: for how long

    def describe(self) -> str:
        return (f"{_why(self.stuck, self.paused, detail=True)}: starting node {self.node}'s rank(s) {self.ranks} "
                f"again to join the running job (restart {self.time})")


def _why(stuck: dict[int, ErrorRecord], paused: dict[int, float], detail: bool = False) -> str:
    """What happened to a node's ranks that may be started again, for the terminal."""
    parts = []
    if stuck:
        where = "; ".join(f"rank {i} in {r.place} ({r.where})" for i, r in sorted(stuck.items()))
        parts.append(f"rank(s) {sorted(stuck)} left stuck in a collective"
                     + (f" ({where}); the process was stuck, not the machine" if detail else ""))
    if paused:
        parts.append(f"rank(s) {sorted(paused)} were fenced while this machine stood still"
                     + (f" for {max(paused.values()):.0f} s (paused whole, as a VM paused by its host or a hung "
                        f"kernel: no process of it ran), for their silence meanwhile; the machine goes on now"
                        if detail else ""))
    return "; ".join(parts)


@dataclass
class StuckRestarts:
    """One launcher's bookkeeping: which error record of each rank was there when its current life started (the
    records of earlier lives stay in the store under the same rank), how often each node came back, and which nodes
    were already judged (each exit is looked at once)."""

    tp: int
    limit: int = MAX_RESTARTS
    before: dict[int, float | None] = field(default_factory=dict)  # rank -> the time of the record before this life
    restarts: dict[int, int] = field(default_factory=dict)  # node -> times started again
    judged: set[int] = field(default_factory=set)  # nodes whose lives all ended and were judged

    def lives_started(self, store: Any, ranks: list[int]) -> None:
        self.before.update(record_times(store, ranks))
        self.judged.difference_update(ident // self.tp for ident in ranks)

    def stuck_record(self, store: Any, ident: int, code: int | None) -> ErrorRecord | None:
        """The record of this life's rank ``ident`` where it left stuck (exit 13 and a ``StuckInCollective``
        record this life wrote: not the one there when it started), else None."""
        if code != LOCAL_ERROR_EXIT:
            return None
        record = read_error(store, ident)
        if record is None or record.type != STUCK_TYPE or record.time == self.before.get(ident):
            return None
        return record

    def due(self, store: Any, codes: dict[int, int | None],
            paused: dict[int, float] | None = None) -> tuple[list[NodeToRestart], list[str]]:
        """The nodes to start again now (``codes``: this machine's ranks' exit codes, None while running;
        ``paused``: ranks the agent fenced while this machine stood still, for how long it did), and what to say
        about nodes that left stuck or were fenced so but are not started again (once each)."""
        paused = paused or {}
        nodes: dict[int, list[int]] = {}
        for ident in sorted(codes):
            nodes.setdefault(ident // self.tp, []).append(ident)
        out, said = [], []
        for node, ranks in nodes.items():
            if node in self.judged or any(codes[i] is None for i in ranks):
                continue
            self.judged.add(node)
            stuck = {i: r for i in ranks if (r := self.stuck_record(store, i, codes[i])) is not None}
            held = {i: paused[i] for i in ranks if i in paused and i not in stuck}
            if not (stuck or held) or STOPPED_EXIT in (codes[i] for i in ranks):  # (the agent stopped the job)
                continue
            why = _why(stuck, held)
            others = {i: codes[i] for i in ranks if i not in stuck and i not in held and codes[i] != 0}
            if others:
                said.append(f"{why}, but node {node}'s rank(s) {sorted(others)} ended otherwise (exit "
                            f"{sorted(set(others.values()))}): not starting the node again")
                continue
            if len(ranks) < self.tp:
                said.append(f"{why}, but node {node} is split over machines (only {ranks} here): not starting it "
                            f"again")
                continue
            done = self.restarts.get(node, 0)
            if done >= self.limit:
                said.append(f"{why} again; node {node} was started again {done} time(s) already (--stuck-restarts "
                            f"{self.limit}): the job goes on without it")
                continue
            self.restarts[node] = done + 1
            out.append(NodeToRestart(node, ranks, stuck, done + 1, held))
        return out, said
