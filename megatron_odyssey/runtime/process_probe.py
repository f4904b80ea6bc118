"""What the operating system says about a rank's process on this machine: its scheduler state and CPU time.

A heartbeat that stops means the process stopped (SIGSTOP, a frozen node) - or that its heartbeat thread got no
time: on an overloaded machine, or while its main thread holds the GIL in a long native call. The agent tells the
two apart before it fences a silent rank: a process that is runnable or still burning CPU has not stopped. Read
from ``/proc`` (Linux); elsewhere, and for ranks on other machines, there is nothing to read and the heartbeat
alone decides.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible wait", "T": "stopped", "t": "stopped by a tracer",
          "Z": "a zombie", "X": "dead", "I": "idle"}
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") and "SC_CLK_TCK" in os.sysconf_names else 100


@dataclass(frozen=True)
class ProcessSample:
    state: str  # /proc's one-letter state: R a thread runs or is runnable, S sleeping, D uninterruptible, T stopped, Z zombie
    cpu_s: float  # user + system time of all its threads
    at: float  # time.monotonic() of the sample

    @property
    def runnable(self) -> bool:
        return self.state == "R"

    def describe(self, since: ProcessSample | None = None) -> str:
        text = f"state {self.state}, {STATES.get(self.state, 'unknown')}"
        if since is not None and self.at > since.at:
            text += f"; {self.cpu_s - since.cpu_s:.2f} s of CPU in the last {self.at - since.at:.1f} s"
        return text


def _stat(path: str) -> list[str]:
    with open(path) as f:
        return f.read().rsplit(")", 1)[1].split()  # (the command name may hold spaces and parentheses)


def sample(pid: int | None) -> ProcessSample | None:
    """The process's state and CPU time now; None where it cannot be read (no /proc, gone, another machine).
    Its state is R when any of its threads runs: /proc/PID/stat's own is the main thread's, which sleeps waiting
    for the GIL while another thread holds it (and its CPU time is every thread's)."""
    if pid is None:
        return None
    try:
        fields = _stat(f"/proc/{pid}/stat")
        state = fields[0]
        if state != "R":
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    if _stat(f"/proc/{pid}/task/{tid}/stat")[0] == "R":
                        state = "R"
                        break
                except (OSError, IndexError):
                    continue  # (a thread that just ended)
        return ProcessSample(state, (int(fields[11]) + int(fields[12])) / _TICKS, time.monotonic())
    except (OSError, IndexError, ValueError):
        return None


def is_zombie(pid: int) -> bool:
    probe = sample(pid)
    return probe is not None and probe.state == "Z"


class SilenceJudge:
    """Whether a rank whose heartbeat is silent has stopped, from its process on this machine.

    Past half the heartbeat timeout the process is sampled once; at the timeout again. A process that is runnable
    then, or that used CPU in between, is not stopped: its heartbeat thread got no time (a loaded machine, or the
    GIL held by its main thread in native code). It gets a grace of a second heartbeat timeout, said on the
    terminal, and is fenced only if still silent at twice the timeout. A process stopped (T), asleep without CPU,
    in an uninterruptible wait or gone is fenced at the timeout, as before. Without a process to read (a rank on
    another machine) the heartbeat alone decides."""

    def __init__(self, timeout_s: float, say: Callable[[str], None]):
        self.timeout_s, self.say = timeout_s, say
        self.first: dict[int, ProcessSample] = {}  # rank -> its sample past half the timeout, this silence
        self.graced: dict[int, float] = {}  # rank -> the longest silence it was given grace in

    def fence(self, ident: int, pid: int | None, silent_s: float) -> tuple[bool, str]:
        """At or past the timeout: (whether to fence now, what its process was doing, for the message)."""
        now = sample(pid)
        if now is None:
            return True, ""
        first = self.first.get(ident)
        detail = now.describe(first)
        running = now.runnable or (first is not None and now.cpu_s - first.cpu_s >= 0.05)
        if not running or now.state in "ZXD" or silent_s >= 2 * self.timeout_s:
            return True, detail
        if ident not in self.graced:
            self.say(f"rank {ident} missed heartbeats for {silent_s:.1f} s, but its process is not stopped ({detail}): "
                     f"its heartbeat thread got no time (a loaded machine, or the GIL held in native code); fenced "
                     f"if still silent at {2 * self.timeout_s:.0f} s")
        self.graced[ident] = silent_s
        return False, detail

    def forget(self, ident: int) -> None:
        """The rank was fenced: a rank that later takes its place starts with a clean slate."""
        self.first.pop(ident, None)
        self.graced.pop(ident, None)

    def look(self, ident: int, pid: int | None, silent_s: float) -> None:
        """Every look at a rank below the timeout: a sample past half of it; a silence that ended is forgotten."""
        if silent_s < self.timeout_s / 2:
            self.first.pop(ident, None)
            if ident in self.graced:
                self.say(f"rank {ident} beats again after {self.graced.pop(ident):.1f} s of silence")
        elif ident not in self.first and (probe := sample(pid)) is not None:
            self.first[ident] = probe
