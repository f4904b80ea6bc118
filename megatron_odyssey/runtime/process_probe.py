"""What the operating system says about a rank's process on this machine: its scheduler state and CPU time.

A heartbeat that stops means the process stopped (SIGSTOP, a frozen node) - or that its heartbeat thread got no
time: on an overloaded machine, or while its main thread holds the GIL in a long native call. The agent tells the
two apart before it fences a silent rank: a process that is runnable or still burning CPU has not stopped. Read
from ``/proc`` (Linux): here for the agent's own machine's ranks (:class:`LocalProcess`), and by each other
machine's node agent for its own, on the agent's request (:class:`RemoteProcess`, :class:`ProbeRequests`). Where
nothing can be read (no ``/proc``, a rank whose launcher is gone or does not answer) the heartbeat alone decides.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

#: the agent asks a rank's node agent to sample its process (``RemoteProcess``; value: a stamp, ``stamp@pid`` when the
#: agent knows which process it means, empty when withdrawn); while asked, the node agent writes a fresh sample, with
#: the stamp, to ``PROBE_KEY`` every ``ProbeRequests.every_s``
PROBE_ASK_KEY = "odyssey/probe-ask/{}"
PROBE_KEY = "odyssey/probe/{}"
#: the pid of a rank launched with the job, said by its machine's node agent at its start (a joining machine's
#: launcher says its ranks' pids in their join requests instead), so that an ask can name the process it means
RANK_PID_KEY = "odyssey/rank-pid/{}"

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

    def encode(self) -> str:
        return f"{self.state} {self.cpu_s!r} {self.at!r}"

    @staticmethod
    def decode(text: str) -> ProcessSample:
        state, cpu_s, at = text.split()
        return ProcessSample(state, float(cpu_s), float(at))

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


def children_of(pid: int) -> list[int]:
    """The process's children, those of every thread of it (raises OSError where /proc has no such process)."""
    children = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children += [int(c) for c in f.read().split()]
        except OSError:
            continue  # (a thread that just ended)
    return children


@dataclass(frozen=True)
class DeadChild:
    """A child process that exited with a failure and that its parent has not waited for (a zombie)."""

    pid: int
    status: int  # the wait status the kernel keeps for the parent (as ``os.waitpid`` would return it)
    started: float  # wall-clock time it started

    def describe(self) -> str:
        code = os.waitstatus_to_exitcode(self.status)
        if code < 0:
            import signal

            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"


def dead_children(pid: int, since: float = 0.0) -> list[DeadChild]:
    """The children of ``pid`` started at ``since`` (wall clock) or later that exited with a failure and were
    not waited for: a parent that waits on them some other way (Megatron's checkpoint writers report through a
    queue) waits forever. Empty where /proc cannot tell (another OS, a kernel older than 3.5)."""
    try:
        with open("/proc/uptime") as f:
            boot = time.time() - float(f.read().split()[0])  # (the start times below count from the boot)
        children = children_of(pid)
    except (OSError, ValueError):
        return []
    out = []
    for child in children:
        try:
            fields = _stat(f"/proc/{child}/stat")
            started = boot + int(fields[19]) / _TICKS  # /proc/PID/stat field 22: start time, ticks after boot
            status = int(fields[49])  # field 52: the exit status (Linux 3.5+)
        except (OSError, IndexError, ValueError):
            continue
        if fields[0] == "Z" and status != 0 and started >= since - 2.0 / _TICKS:
            out.append(DeadChild(child, status, started))
    return out


def is_zombie(pid: int) -> bool:
    probe = sample(pid)
    return probe is not None and probe.state == "Z"


class ProcessProbe(Protocol):
    """A rank's process as the agent can look at it: sampled now (None: nothing to read), whether an answer is on
    its way (asked, not yet answered), and let go of."""

    def sample(self) -> ProcessSample | None: ...

    def awaiting(self) -> bool: ...

    def release(self) -> None: ...


class LocalProcess:
    """A rank on the agent's own machine: its ``/proc``."""

    def __init__(self, pid: int):
        self.pid = pid

    def sample(self) -> ProcessSample | None:
        return sample(self.pid)

    def awaiting(self) -> bool:
        return False  # (read at once)

    def release(self) -> None:
        pass


class RemoteProcess:
    """A rank on another machine, sampled by its node agent (:class:`ProbeRequests`) once asked: the first look asks
    and finds nothing yet; later looks read the newest answer. An answer that has not changed for ``stale_s`` (the
    node agent, or its machine, stopped) counts as nothing to read, as does no answer ``stale_s`` after the ask: the
    heartbeat alone decides. ``pid``: the process meant (a rank that asked to join gave it; else its node agent said it
    at its start, ``RANK_PID_KEY``): only that process answers, not another life of the same rank."""

    def __init__(self, store: Any, ident: int, stale_s: float = 2.0, every_s: float = 0.1, pid: int | None = None):
        self.store, self.ident, self.stale_s, self.every_s, self.pid = store, ident, stale_s, every_s, pid
        self.asked: str | None = None  # the stamp of the standing ask; answers carry it back
        self.last: ProcessSample | None = None
        self.changed_at = self.read_at = 0.0  # time.monotonic() here when the answer last changed / was read
        self.asked_at = 0.0  # time.monotonic() here of the standing ask

    def sample(self) -> ProcessSample | None:
        if self.asked is None:
            if self.pid is None and self.store.check([key := RANK_PID_KEY.format(self.ident)]):
                self.pid = int(self.store.get(key))
            stamp = repr(time.time()) if self.pid is None else f"{time.time()!r}@{self.pid}"
            self.asked, self.last, self.asked_at = stamp, None, time.monotonic()
            self.store.set(PROBE_ASK_KEY.format(self.ident), self.asked)
            return None
        now = time.monotonic()
        if now - self.read_at >= self.every_s:  # (the agent looks every few ms: the store is asked less often)
            self.read_at = now
            key = PROBE_KEY.format(self.ident)
            stamp, _, answer = self.store.get(key).decode().partition(" ") if self.store.check([key]) else ("", "", "")
            if stamp == self.asked and (fresh := ProcessSample.decode(answer)) != self.last:
                self.last, self.changed_at = fresh, now  # (an answer to an earlier ask, written late, is not one)
        return self.last if self.last is not None and now - self.changed_at < self.stale_s else None

    def awaiting(self) -> bool:
        """Asked, not answered yet, and the node agent still has time to (it answers every half second)."""
        return self.asked is not None and self.last is None and time.monotonic() - self.asked_at < self.stale_s

    def release(self) -> None:
        if self.asked is not None:
            # withdrawn by emptying it, not deleting it: the node agent's read of the key must not wait for it
            self.store.set(PROBE_ASK_KEY.format(self.ident), "")
            self.store.delete_key(PROBE_KEY.format(self.ident))
            self.asked, self.last = None, None


def probe_of(rank: Any) -> ProcessProbe | None:
    """How the agent can look at a rank it supervises: the probe the rank brings (``process_probe``: one on another
    machine), else its pid here, else nothing."""
    probe = getattr(rank, "process_probe", None)
    if probe is not None:
        return probe
    pid = getattr(rank, "pid", None)
    return LocalProcess(pid) if pid else None


class ProbeRequests:
    """A node agent's half: each of its ranks the agent asked about (``PROBE_ASK_KEY``) is sampled and the sample
    written back, every ``every_s``, for as long as the ask stands. An ask that names another process than the
    rank's here (its earlier or later life) is not answered, nor, with ``named_only`` (for every rank, or the ranks
    for which it says True: those whose life here joined the job), one that names none."""

    def __init__(self, pids: Callable[[], dict[int, int]], every_s: float = 0.5,
                 named_only: bool | Callable[[int], bool] = False):
        self.pids, self.every_s, self.polled = pids, every_s, 0.0
        self.named_only = named_only if callable(named_only) else (lambda ident: named_only)

    def poll(self, store: Any) -> None:
        if time.monotonic() - self.polled < self.every_s:
            return
        self.polled = time.monotonic()
        for ident, pid in self.pids().items():
            ask = PROBE_ASK_KEY.format(ident)
            stamp = store.get(ask).decode() if store.check([ask]) else ""  # ("": withdrawn)
            meant = stamp.partition("@")[2]
            ours = meant == str(pid) or not (meant or self.named_only(ident))
            if stamp and ours and (now := sample(pid)) is not None:
                store.set(PROBE_KEY.format(ident), f"{stamp} {now.encode()}")


class SilenceJudge:
    """Whether a rank whose heartbeat is silent has stopped, from its process (here, or through its node agent).

    Past half the heartbeat timeout the process is sampled once; at the timeout again. A process that is runnable
    then, or that used CPU in between, is not stopped: its heartbeat thread got no time (a loaded machine, or the
    GIL held by its main thread in native code). It gets a grace of a second heartbeat timeout, said on the
    terminal, and is fenced only if still silent at twice the timeout. A process stopped (T), asleep without CPU,
    in an uninterruptible wait or gone is fenced at the timeout, as before. Without a process to read (no probe, or
    one that has no answer) the heartbeat alone decides; a probe first asked at the timeout (nobody looked at the
    rank past half of it: the agent's own pass was late on a loaded machine) is given its answer's time first.
    ``rank``: the rank as the agent supervises it (:func:`probe_of`)."""

    def __init__(self, timeout_s: float, say: Callable[[str], None]):
        self.timeout_s, self.say = timeout_s, say
        self.first: dict[int, ProcessSample] = {}  # rank -> its sample past half the timeout, this silence
        self.graced: dict[int, float] = {}  # rank -> the longest silence it was given grace in
        # rank -> (the process supervised, its probe), from half the timeout until the silence ends
        self.watched: dict[int, tuple[Any, ProcessProbe]] = {}

    def _probe(self, ident: int, rank: Any) -> ProcessProbe | None:
        if ident in self.watched and self.watched[ident][0] is not rank:  # (another process took the rank's place)
            self._release(ident)
        if ident not in self.watched and (probe := probe_of(rank)) is not None:
            self.watched[ident] = rank, probe
        return self.watched[ident][1] if ident in self.watched else None

    def _release(self, ident: int) -> None:
        if (watched := self.watched.pop(ident, None)) is not None:
            watched[1].release()

    def fence(self, ident: int, rank: Any, silent_s: float) -> tuple[bool, str]:
        """At or past the timeout: (whether to fence now, what its process was doing, for the message)."""
        probe = self._probe(ident, rank)
        now = probe.sample() if probe is not None else None
        if now is None:
            return probe is None or not probe.awaiting() or silent_s >= 2 * self.timeout_s, ""
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
        self._release(ident)

    def look(self, ident: int, rank: Any, silent_s: float) -> None:
        """Every look at a rank below the timeout: a sample past half of it; a silence that ended is forgotten."""
        if silent_s < self.timeout_s / 2:
            self.first.pop(ident, None)
            self._release(ident)
            if ident in self.graced:
                self.say(f"rank {ident} beats again after {self.graced.pop(ident):.1f} s of silence")
        elif ident not in self.first and (probe := self._probe(ident, rank)) is not None \
                and (first := probe.sample()) is not None:
            self.first[ident] = first
