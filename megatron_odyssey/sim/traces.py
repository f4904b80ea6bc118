"""Spot-instance availability traces: ``time_ms,add|remove,nodeNAME`` per line, no header.

Events at time 0 build the initial cluster (a trace may also start empty and grow, e.g.
``ec2-g4dn-spot.csv``, whose first nodes arrive at 480 s). Node names may come back after a
removal. A trace node is one simulator node (one TP group). A malformed line stops the run with
:class:`TraceFormatError` naming the file and line number; nothing is guessed.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..planning.errors import read_user_file
from .errors import SimulationError, TraceFormatError

_NODE = re.compile(r"node\S+")
OPS = ("add", "remove")


@dataclass(frozen=True)
class TraceEvent:
    time_s: float
    op: str  # "add" | "remove"
    node: str
    line_no: int


@dataclass(frozen=True)
class Trace:
    path: str
    events: tuple[TraceEvent, ...]

    @property
    def duration_s(self) -> float:
        return self.events[-1].time_s if self.events else 0.0

    @property
    def node_names(self) -> tuple[str, ...]:
        """Every name in order of first appearance (the simulator's node ids follow this order)."""
        seen: dict[str, None] = {}
        for e in self.events:
            seen.setdefault(e.node, None)
        return tuple(seen)

    def max_alive(self) -> int:
        alive: set[str] = set()
        best = 0
        for e in self.events:
            (alive.add if e.op == "add" else alive.discard)(e.node)
            best = max(best, len(alive))
        return best


def parse_trace_lines(lines: list[str], path: str = "<trace>") -> Trace:
    """Parse and check every line: three comma-separated fields, integer ms >= 0 in
    non-decreasing order, ``add``/``remove``, a ``node...`` name; an add of a present node or a
    remove of an absent one is also an error (the trace would contradict itself)."""
    events: list[TraceEvent] = []
    alive: set[str] = set()
    last_seen: dict[str, tuple[str, int, int]] = {}  # node -> (op, line, ms) of its latest event
    last_ms = 0
    for i, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line:
            continue  # blank lines (e.g. a trailing newline) carry no event
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            raise TraceFormatError(path, i, line, f"{len(parts)} comma-separated fields, expected 3")
        ms_text, op, node = parts
        try:
            ms = int(ms_text)
        except ValueError:
            raise TraceFormatError(path, i, line, f"time {ms_text!r} is not an integer number of milliseconds") from None
        if ms < 0:
            raise TraceFormatError(path, i, line, f"time {ms} ms is negative")
        if ms < last_ms:
            raise TraceFormatError(path, i, line, f"time {ms} ms goes back (previous event at {last_ms} ms)")
        if op not in OPS:
            raise TraceFormatError(path, i, line, f"event {op!r} is neither 'add' nor 'remove'")
        if not _NODE.fullmatch(node):
            raise TraceFormatError(path, i, line, f"node name {node!r} does not look like 'nodeNAME'")
        if op == "add" and node in alive:
            _, at_line, at_ms = last_seen[node]
            raise TraceFormatError(path, i, line, f"at {ms} ms {node} is added, but it is already in the cluster "
                                   f"(added at {at_ms} ms, line {at_line})", show_format=False)
        if op == "remove" and node not in alive:
            if node in last_seen:
                _, at_line, at_ms = last_seen[node]
                why = f"at {ms} ms {node} is removed, but it already left the cluster at {at_ms} ms (line {at_line})"
            else:
                why = (f"at {ms} ms {node} is removed, but it was never added; the cluster is built by the "
                       f"events at time 0 (e.g. '0,add,{node}') and grows by later 'add' lines")
            raise TraceFormatError(path, i, line, why, show_format=False)
        (alive.add if op == "add" else alive.discard)(node)
        last_seen[node] = (op, i, ms)
        last_ms = ms
        events.append(TraceEvent(ms / 1000.0, op, node, i))
    if not events:
        raise SimulationError(f"{path}: the trace has no events (expected lines 'time_ms,add|remove,nodeNAME')")
    return Trace(path, tuple(events))


def load_trace(path: str | Path) -> Trace:
    p = Path(path)
    text = read_user_file(p, str(p), "a trace file (lines 'time_ms,add|remove,nodeNAME')", SimulationError)
    return parse_trace_lines(text.splitlines(), str(p))
