"""What a rank tells the agent besides its protocol messages: that it lives and that it progresses.

A heartbeat alone proves only that the process runs: a rank stuck inside a collective or a kernel keeps
beating from its daemon thread. So each beat also carries the rank's :class:`Progress`: a counter the
main thread bumps at every operation boundary (a forward or backward op, gradient sync, the optimizer)
and what it is doing: ``working`` inside a step (computing), ``comm`` blocked in one of our
communication calls (a receive, a gradient all-reduce: waiting on peers), ``waiting`` on the agent
(commit, plan, start of a generation), ``idle`` outside a step (the host's own loop: Megatron's logging
and checkpoint saves). Between steps a beat also tells *where* the rank is: its step and how many of the loop's
stops after it (Megatron's ``training_log``, a save, the exit check) it has entered; every rank makes the same
stops in the same order, so a rank behind every other while none of them moves is what they all wait for; and
whether its main thread waits in one of torch.distributed's collectives there (sampled by the heartbeat thread:
Megatron's own collectives between steps are not ours to mark), so among ranks at the same stop the one that never
entered the collective the others wait in is found too.
The agent judges ranks inside a step by progress (``progress_judge.ProgressJudge``), with
a soft timeout (name the rank, dump its stacks) and a hard one (fence it and recover), as Megatron's
in-process restart does with ``--inprocess-soft-timeout``/``--inprocess-hard-timeout``. As in C4D, who
waits tells who is at fault: ranks blocked in communication wait on a peer; a rank stopped while
*working* (in its own computation, or in a collective its peers never entered) is the cause.

Threads that talk to the store (:class:`StoreThread`) survive a store hiccup: an error is said on
stderr and retried with a fresh client; only a store that stays unreachable for ``grace_s`` ends them.
"""
from __future__ import annotations

import inspect
import linecache
import os
import re
import sys
import threading
import time
import types
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator

WORKING, COMM, WAITING, IDLE = "working", "comm", "waiting", "idle"


@dataclass
class Progress:
    """Written by the rank's main thread (plain attribute stores: no lock on the hot path), read by its
    heartbeat thread. ``since`` is the wall-clock time of the last change, so the agent can tell which of
    several stalled ranks stopped first (the others were waiting on it)."""

    count: int = 0
    state: str = IDLE
    step: int = -1
    phase: str = ""
    since: float = field(default_factory=time.time)
    stop: int = 0  # stops of the loop entered since step ``step``'s work (0: inside the step)

    def mark(self, step: int, phase: str) -> None:
        if step != self.step:
            self.stop = 0
        self.step, self.phase, self.state = step, phase, WORKING
        self.count += 1
        self.since = time.time()

    def rest(self, step: int, phase: str) -> None:
        """Entering a stop of the host's loop after ``step`` (``phase``: log, save, exit, between): the rank is
        then at position ``(step, stop)``, after every rank still inside ``step`` or at an earlier stop."""
        self.stop = self.stop + 1 if step == self.step else 1
        self.step, self.phase, self.state = step, phase, IDLE
        self.count += 1
        self.since = time.time()

    def set_state(self, state: str) -> None:
        self.state = state
        self.count += 1
        self.since = time.time()

    def beat(self, in_collective: bool = False) -> str:
        """The heartbeat value: ``time count state step phase since stop in_collective``."""
        return (f"{time.time()!r} {self.count} {self.state} {self.step} {self.phase or '-'} {self.since!r} {self.stop} "
                f"{int(in_collective)}")


@dataclass(frozen=True)
class Beat:
    t: float
    count: int = 0
    state: str = IDLE
    step: int = -1
    phase: str = ""
    since: float = 0.0
    stop: int = 0
    in_collective: bool = False  # at rest, its main thread blocked in a torch.distributed collective

    @property
    def position(self) -> tuple[int, int]:
        """Where the rank is in the loop every rank runs alike: inside step ``s`` is ``(s, 0)``, the ``k``-th stop
        after it ``(s, k)``."""
        return self.step, self.stop

    @classmethod
    def parse(cls, value: bytes | str) -> "Beat":
        parts = (value.decode() if isinstance(value, bytes) else value).split()
        if len(parts) < 6:  # a bare time (a rank that reports no progress)
            return cls(float(parts[0]), since=float(parts[0]))
        return cls(float(parts[0]), int(parts[1]), parts[2], int(parts[3]), "" if parts[4] == "-" else parts[4],
                   float(parts[5]), int(parts[6]) if len(parts) > 6 else 0, len(parts) > 7 and parts[7] == "1")


_PROCESS: list[Progress | None] = [None]  # this process's rank (one rank per process)
_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")


def in_collective(thread_id: int | None = None) -> bool:
    """Whether the thread (the main one by default: where a rank trains) is blocked in one of torch.distributed's
    collectives: its innermost Python frame is in ``distributed_c10d`` (the C++ wait below it has none), or at the
    ``wait()`` of a named Work handle (:func:`collective_frame`). True for gloo's collectives and any collective's
    ``wait``; an NCCL collective returns at once and its rank waits later, in whatever first needs the result, which
    this does not see."""
    return collective_frame(thread_id) is not None


def collective_frame(thread_id: int | None = None) -> Any:
    """The frame of the torch.distributed call the thread (the main one by default) is blocked in, or None
    (:func:`in_collective`): a frame of ``distributed_c10d``, or one blocked at ``<name>.wait()`` where the name is a
    torch.distributed ``Work`` (:func:`waits_on_work`)."""
    frame = sys._current_frames().get(thread_id if thread_id is not None else threading.main_thread().ident)
    if frame is None:
        return None
    return frame if is_c10d_frame(frame) or waits_on_work(frame) else None


def is_c10d_frame(frame: Any) -> bool:
    """Whether ``frame`` is one of torch.distributed's own functions (``distributed_c10d``)."""
    return frame.f_code.co_filename.endswith(_C10D)


_WAIT_CALL = re.compile(r"(?<![\w.)\]])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\.wait\(\s*\)")


def waits_on_work(frame: Any) -> bool:
    """Whether the innermost ``frame`` is at a ``<name>.wait()`` whose name holds a torch.distributed ``Work``. A
    Work's ``wait`` is C++ and makes no frame of its own, so a rank blocked in it - an asynchronous collective's
    handle waited for later, as this package's gradient sync, transport and state transfer do - shows only the
    caller's frame, outside ``distributed_c10d``. The name is looked up without running code (``getattr_static``):
    this runs on another thread than the one waiting. (A handle waited on without a name, ``isend(...).wait()``, is
    not seen.)"""
    match = _WAIT_CALL.search(linecache.getline(frame.f_code.co_filename, frame.f_lineno))
    if match is None:
        return False
    head, *attrs = match.group(1).split(".")
    missing = object()
    found = frame.f_locals.get(head, frame.f_globals.get(head, missing))
    for attr in attrs:
        if found is missing:
            return False
        owner, found = found, inspect.getattr_static(found, attr, missing)
        if isinstance(found, types.MemberDescriptorType):  # a __slots__ field: its value, read without code
            found = found.__get__(owner)
    return found is not missing and _is_work(found)


def _is_work(value: Any) -> bool:
    """A torch.distributed ``Work`` (without importing torch here: a process that has none has no Work either)."""
    work = getattr(sys.modules.get("torch.distributed"), "Work", None)
    return work is not None and isinstance(value, work)


def main_thread_place() -> str:
    """Where the main thread is: its innermost Python frame, as file:line in function."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "unknown"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def track(progress: Progress) -> None:
    """Make ``progress`` the one :func:`communicating` marks (the rank's own, set by its host)."""
    _PROCESS[0] = progress


def communicating() -> ContextManager[None]:
    """Around a blocking communication call: the rank is waiting on peers, not stuck itself."""
    return _switched(WORKING, COMM)


def on_own_device() -> ContextManager[None]:
    """Around a wait on the rank's own device inside a communication call (a host-staged message copied off or onto
    the device, which waits for the kernels before it): a rank blocked there is stuck itself - its device hangs, as
    under nvidia-resiliency-ext's GPU_SLEEP - not waiting on a peer, so the agent must blame it, not the peers that
    wait for its message (they entered their waits earlier and would look stopped longest)."""
    return _switched(COMM, WORKING)


@contextmanager
def _switched(usual: str, meanwhile: str) -> Iterator[None]:
    """The rank's state ``meanwhile`` for a while, where it is ``usual`` now (else left as it is)."""
    progress = _PROCESS[0]
    if progress is None or progress.state != usual:
        yield
        return
    progress.set_state(meanwhile)
    try:
        yield
    finally:
        progress.set_state(usual)


class StoreThread(threading.Thread):
    """A daemon thread doing one small store operation every ``interval_s`` (:meth:`tick`) over its own
    client. A store error is retried with a fresh client and said once on stderr (and when the store
    answers again); a store unreachable for ``grace_s`` calls :meth:`lost` and ends the thread. With a standby
    agent (``control``, a ``control_plane.ControlPlane``) it reconnects to whichever agent is in charge, for up to
    the control plane's wait, and holds a client of the standby's store from its start (``ControlPlane.ready``)."""

    what = "store thread"

    def __init__(self, host: str, port: int, ident: int, interval_s: float, grace_s: float = 10.0,
                 connect: Callable[[], Any] | None = None, control: Any = None):
        super().__init__(daemon=True, name=f"odyssey-{self.what.replace(' ', '-')}")
        if control is not None:
            connect, grace_s = connect or control.connect, control.wait_s
        self.rank, self.interval_s, self.grace_s, self.control = ident, interval_s, grace_s, control
        self._connect = connect or (lambda: _client(host, port, grace_s))
        self.store: Any = None
        self.stopped = threading.Event()
        self.retries = 0
        import atexit

        atexit.register(self.stop)  # a thread still inside the store client at interpreter exit aborts it

    def tick(self, store: Any) -> None:
        raise NotImplementedError

    def lost(self, exc: BaseException) -> None:
        """The store stayed unreachable for ``grace_s``."""

    def say(self, text: str) -> None:
        print(f"[odyssey rank {self.rank}] {self.what}: {text}", file=sys.stderr, flush=True)

    def stop(self) -> None:
        self.stopped.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(5)

    def run(self) -> None:
        if self.control is not None:
            self.control.ready()
        failing_since: float | None = None
        while not self.stopped.is_set():
            try:
                if self.store is None:
                    self.store = self._connect()
                self.tick(self.store)
                if failing_since is not None:
                    self.say(f"the store answers again after {time.monotonic() - failing_since:.1f} s")
                    failing_since = None
            except Exception as exc:  # noqa: BLE001 - any store error is retried, then reported
                if self.stopped.is_set():
                    return
                self.store, self.retries = None, self.retries + 1
                now = time.monotonic()
                if failing_since is None:
                    failing_since = now
                    self.say(f"store error ({type(exc).__name__}: {str(exc)[:160]}); retrying for up to "
                             f"{self.grace_s:.0f} s")
                elif now - failing_since > self.grace_s:
                    self.say(f"the store has been unreachable for {now - failing_since:.1f} s: giving up")
                    self.lost(exc)
                    return
            self.stopped.wait(self.interval_s)


def _client(host: str, port: int, timeout_s: float) -> Any:
    from .control_plane import client

    return client((host, port), max(1.0, timeout_s))


class Heartbeat(StoreThread):
    """Proves liveness and reports progress to the agent; stops with the process (SIGSTOP stops it too).
    With a standby agent (``control``) it beats to whichever agent is in charge, and after a takeover it
    obeys the rank's fence key (its launcher may be gone with the lost agent's machine)."""

    what = "heartbeat"

    def __init__(self, host: str, port: int, ident: int, interval_s: float, progress: Progress | None = None,
                 control: Any = None, **kw: Any):
        super().__init__(host, port, ident, interval_s, control=control, **kw)
        self.key, self.progress = f"odyssey/hb/{ident}", progress or Progress()
        self.last_beat: float | None = None  # time.monotonic() of the last beat sent
        self.retries_at_beat = 0  # store errors before it
        self.writers = SaveWriters()
        from .reachability import Prober

        self.prober = Prober(ident, host, port)  # which peers this rank reaches, when the agent asks

    def tick(self, store: Any) -> None:
        store.set(self.key, self.progress.beat(self.progress.state == IDLE and in_collective()))
        self.writers.check(self.progress, store, self.rank)
        self.prober.tick(store)
        now = time.monotonic()
        # (a beat after a store error is late by the time it took to reach a store again, said already)
        late = now - self.last_beat - self.interval_s if self.last_beat is not None and \
            self.retries == self.retries_at_beat else 0.0
        self.last_beat, self.retries_at_beat = now, self.retries
        if late > max(1.0, 5 * self.interval_s):  # (the agent may have taken the silence for a hang: say why)
            self.say(f"this beat is {late:.1f} s late: the process got no CPU time, its main thread held the GIL, or "
                     f"the store answered slowly (the main thread is now at {main_thread_place()})")
        if self.control is not None and self.control.fenced(store):
            from .errors import stop_now

            stop_now(self.rank, "the agent fenced this rank (its launcher is gone): leaving", code=137)


class CheckpointWriterDied(RuntimeError):
    """A process the rank started for its checkpoint save died before it reported back: the save never ends."""


class SaveWriters:
    """Watches, from the heartbeat thread, the processes a rank forks during a checkpoint save (Megatron's
    dist-checkpointing writers, core_r0.12-0.16's ``FileSystemWriterAsync.write_preloaded_data_multiproc``; from
    core_r0.17.0 on they are threads, and a writer dies only with its rank): each reports through a
    joinable queue, so one that dies first (killed by the OOM killer; psutil missing, which core_r0.13-0.16's
    ``_process_memory`` asks first) leaves the rank in ``count_queue.join()`` forever, and its peers in the save's
    collectives. One dead for ``grace_s`` while the rank is still in the save (a writer that failed after it
    reported is reaped at once) makes the rank fail with that cause: the agent recovers without it, or stops the
    job when every rank's writers die alike, and the last complete checkpoint stays."""

    def __init__(self, grace_s: float = 3.0):
        self.grace_s = grace_s
        self.seen: dict[int, float] = {}  # dead child's pid -> when this watch first saw it

    def check(self, progress: Progress, store: Any, rank: int) -> None:
        if progress.phase != "save" or progress.state != IDLE:
            self.seen.clear()
            return
        from .process_probe import dead_children

        now = time.monotonic()
        for child in dead_children(os.getpid(), since=progress.since):
            if now - self.seen.setdefault(child.pid, now) < self.grace_s:
                continue
            from .errors import fail_locally

            try:
                raise CheckpointWriterDied(
                    f"checkpoint writer process {child.pid} died ({child.describe()}) during the save after step "
                    f"{progress.step} before it reported: the save waits for every writer and would never end (the "
                    f"writer's own error, if it printed one, is in this rank's log). This rank leaves; the last "
                    f"complete checkpoint stays")
            except CheckpointWriterDied as exc:
                fail_locally(store, rank, exc, where=f"the save after step {progress.step}")

