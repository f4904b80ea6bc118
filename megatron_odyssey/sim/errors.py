"""Errors the simulator raises for input it cannot simulate.

``SimulationError`` is a ``ValueError`` so the CLI can turn it into a one-line message; the
message always names the offending value and what would be accepted instead.
"""
from __future__ import annotations


class SimulationError(ValueError):
    """Bad simulation configuration (sizes, policies, rates); the message says what and why."""


class TraceFormatError(SimulationError):
    """A trace line that does not read as ``time_ms,add|remove,nodeNAME``, or contradicts the lines
    before it (a node removed that is not there, or added twice).

    Carries the file and 1-based line number so the user can fix the trace; the run stops.
    """

    def __init__(self, path: str, line_no: int, line: str, why: str, show_format: bool = True):
        self.path = path
        self.line_no = line_no
        self.line = line
        self.why = why
        hint = "; expected 'time_ms,add|remove,nodeNAME'" if show_format else ""
        super().__init__(f"{path}:{line_no}: {why} (line: {line!r}){hint}")
