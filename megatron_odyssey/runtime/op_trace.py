"""A rank's record of its operations in one step, for the agent's C4D-style diagnosis (``diagnosis``).

Per step the executor (or, before a Megatron-LM job's first failure, Megatron's own schedule through
``megatron_lm.stock_trace`` and its patches) notes how long each compute operation took (without the time it waited for its
input), and for each point-to-point message when it was handed to the transport (send) or when the rank
started waiting for it and when it arrived (receive); the gradient sync notes when it entered and left each
unit's all-reduce; the commit wait is timed as a whole. Nothing here synchronises or talks to anyone: plain appends on the rank's own thread, bounded per
step, and one compact JSON value the rank writes to the store with its ready share.

Times of messages are wall-clock (``time.time()``), so the agent can match a send on one rank with its
receive on another: ranks on one machine share the clock; across machines NTP keeps them within a
millisecond or so, which is what C4D relies on too.
"""
from __future__ import annotations

import json
import statistics
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

MAX_MESSAGES = 256  # per step and direction: the summary stays small however many micro-batches run
# an operation begun after its thread slept this long starts cold (on the CPU it then read 4.8x its usual CPU time,
# ``benchmarks/bench_cold_after_sleep.py``): the diagnosis compares how many of each node's operations did
COLD_AFTER_S = 0.01


@dataclass
class OpTrace:
    ident: int
    node: int
    step: int = -1
    forward_s: list[float] = field(default_factory=list)
    backward_s: list[float] = field(default_factory=list)  # backward and (filled reroutes) weight-gradient ops
    sends: list[tuple[int, str, float]] = field(default_factory=list)  # (destination node, message, entered)
    recvs: list[tuple[int, str, float, float]] = field(default_factory=list)  # (source node, message, entered, done)
    reductions: list[tuple[int, float, float]] = field(default_factory=list)  # gradient all-reduce: (unit, entered, left)
    sync_s: float = 0.0
    commit_wait_s: float = 0.0  # the previous step's commit (it comes after that step's summary left)
    # compute timed by device events (accelerators), read when the summary is written: (kind, begin, end)
    on_device: list[tuple[str, Any, Any]] = field(default_factory=list)
    # seconds the rank's thread slept between its compute operations this step (blocked in a wait, or an injected
    # slow link's hold; not computing, not queued for a core): on the CPU an operation right after idling reads
    # several times its CPU time (``diagnosis``)
    idle_s: float = 0.0
    # of the operations that followed another of this step (the first has none): how many, and how many of them
    # began after sleeping longer than COLD_AFTER_S (the share tells a rank that waited before nearly every operation
    # from one that waited once, as long in all, and then ran warm)
    followed: int = 0
    cold: int = 0
    _ended: float | None = None  # the thread's off-CPU clock when this step's newest operation ended

    def begin(self, step: int) -> None:
        self.step = step
        self.forward_s.clear()
        self.backward_s.clear()
        self.sends.clear()
        self.recvs.clear()
        self.reductions.clear()
        self.on_device.clear()
        self.sync_s = 0.0
        self.idle_s = 0.0
        self.followed = self.cold = 0
        self._ended = None

    def operation_started(self) -> None:
        if self._ended is not None:
            slept = max(0.0, sleeping_clock() - self._ended)
            self.idle_s += slept
            self.followed += 1
            self.cold += slept > COLD_AFTER_S

    def operation_ended(self) -> None:
        self._ended = sleeping_clock()

    def computed(self, kind: str, seconds: float) -> None:
        (self.forward_s if kind == "forward" else self.backward_s).append(seconds)

    def computed_on_device(self, kind: str, begin: Any, end: Any) -> None:
        """An operation's kernels, between two recorded device events; their time is read at the summary
        (reading it now would wait for the kernels: a host-device synchronisation per operation)."""
        if len(self.on_device) < 2 * MAX_MESSAGES:
            self.on_device.append((kind, begin, end))

    def _read_device_times(self) -> None:
        """Once per step, when the rank reports it: the step's kernels are done or nearly (the last stage
        already waited for its loss), so waiting for the last event costs little."""
        for kind, begin, end in self.on_device:
            end.synchronize()
            self.computed(kind, begin.elapsed_time(end) / 1e3)
        self.on_device.clear()

    def sent(self, node: int, message: str, entered: float) -> None:
        if len(self.sends) < MAX_MESSAGES:
            self.sends.append((node, message, entered))

    def received(self, node: int, message: str, entered: float, done: float) -> None:
        if len(self.recvs) < MAX_MESSAGES:
            self.recvs.append((node, message, entered, done))

    def all_reduced(self, unit: int, entered: float, left: float) -> None:
        if len(self.reductions) < MAX_MESSAGES:
            self.reductions.append((unit, entered, left))

    def summary(self) -> str | None:
        """This step's record as compact JSON; None when the step ran none of our operations (a Megatron-LM
        step before the first failure runs Megatron's own schedule)."""
        self._read_device_times()
        if not self.forward_s and not self.backward_s:
            return None
        out: dict[str, Any] = {
            "step": self.step, "node": self.node,
            # compute per micro-batch (what the diagnosis compares), and the forward and backward operations
            "c": round((sum(self.forward_s) + sum(self.backward_s)) / max(1, len(self.forward_s)), 7),
            "f": _stats(self.forward_s), "b": _stats(self.backward_s),
            "sync": round(self.sync_s, 6), "commit": round(self.commit_wait_s, 6),
            "idle": round(self.idle_s / (len(self.forward_s) + len(self.backward_s)), 7),  # per operation
            "cold": round(self.cold / self.followed, 4) if self.followed else 0.0,  # share begun cold
            "tx": [[n, m, round(t, 6)] for n, m, t in self.sends],
            "rx": [[n, m, round(a, 6), round(b, 6)] for n, m, a, b in self.recvs],
            "ar": [[u, round(a, 6), round(b, 6)] for u, a, b in self.reductions],
        }
        return json.dumps(out, separators=(",", ":"))


def sleeping_clock() -> float:
    """Seconds the calling thread has spent asleep (blocked or waiting, neither running nor queued for a core):
    wall time less its time on a core and in the run queue (Linux's per-thread schedstat). A rank preempted on a
    busy host is not idle; its core stays warm. A wait for the GIL held by another thread of the process is a
    sleep like any blocked wait. Without schedstat: wall time less the thread's CPU time."""
    try:
        tid = threading.get_native_id()  # (a forked child's thread inherits its parent thread's local)
        if getattr(_SCHEDSTAT, "tid", None) != tid:
            _SCHEDSTAT.file, _SCHEDSTAT.tid = open(f"/proc/self/task/{tid}/schedstat", "rb", buffering=0), tid
        f = _SCHEDSTAT.file
        f.seek(0)
        on_cpu_ns, queued_ns = f.read().split()[:2]
        return time.monotonic() - (int(on_cpu_ns) + int(queued_ns)) / 1e9
    except (OSError, ValueError):
        return time.monotonic() - time.thread_time()


_SCHEDSTAT = threading.local()  # each thread's own schedstat, kept open (a read is ~6 us, an open ~25 us)


def compute_clock(device: Any) -> Callable[[], float]:
    """The host clock of an operation's compute. On the CPU the thread's CPU time: several ranks share few
    cores, and wall time would mostly measure whose turn it was (a rank descheduled mid-operation looks 3x
    slower; see docs/benchmarks.md, diagnosis); compute runs on the calling thread there (OMP_NUM_THREADS=1).
    On an accelerator wall time, for what the host does; the kernels are timed by :func:`compute_events`."""
    return time.thread_time if str(device).split(":")[0] == "cpu" else time.perf_counter


def compute_events(device: Any) -> Callable[[], Any] | None:
    """A factory of timing events of ``device`` (CUDA, Ascend), or None on the CPU. Kernels run
    asynchronously: the host's clock between its calls measures launches, a device event pair the kernels."""
    kind = str(device).split(":")[0]
    if kind == "cpu":
        return None
    import functools

    from .accelerator import get_accelerator

    return functools.partial(get_accelerator(kind).module.Event, enable_timing=True)


@dataclass
class ComputeTimer:
    """Times a rank's compute operations for its trace, and stretches them by an injected sustained slowdown
    (``faults.Injector.pace``). One object for both schedules that run a rank's compute: our executor, and
    Megatron's own 1F1B before a Megatron-LM job's first failure (``megatron_lm.hooks.timed_backward_step``).
    With ``events`` (an accelerator) an operation is a pair of device events, read once per step
    (``OpTrace.summary``); while an injected slowdown is in force (``slowed``, testing) each operation waits
    for its kernels instead, so the slowdown can stretch their real time."""

    clock: Callable[[], float]
    trace: OpTrace | None = None
    pace: Callable[[str, float], None] | None = None
    events: Callable[[], Any] | None = None
    slowed: Callable[[], bool] | None = None
    last_s: float = 0.0  # the newest operation's (what a message it produced took to compute)

    @classmethod
    def for_device(cls, device: Any, trace: OpTrace | None = None, pace: Callable[[str, float], None] | None = None,
                   slowed: Callable[[], bool] | None = None) -> "ComputeTimer":
        """The timer of compute on ``device``: its host clock, and its events on an accelerator."""
        return cls(compute_clock(device), trace, pace, compute_events(device), slowed)

    def start(self) -> Any:
        """Mark an operation's start (pass the result to :meth:`stop`)."""
        if self.trace is not None:
            self.trace.operation_started()
        if self.events is None:
            return self.clock()
        begin = self.events()
        begin.record()
        return begin, self.clock()

    def stop(self, phase: str, started: Any) -> float:
        """The operation of ``phase`` (forward/backward) begun at ``started`` is launched: record it; returns
        its compute time (the host's, with an accelerator outside an injected slowdown)."""
        seconds = self._recorded(phase, started)
        if self.trace is not None:
            self.trace.operation_ended()
        return seconds

    def _recorded(self, phase: str, started: Any) -> float:
        if self.events is None:
            return self.done(phase, self.clock() - started)
        begin, host0 = started
        end = self.events()
        end.record()
        if self.slowed is not None and self.slowed():
            end.synchronize()
            return self.done(phase, begin.elapsed_time(end) / 1e3)
        if self.trace is not None:
            self.trace.computed_on_device(phase, begin, end)
        self.last_s = self.clock() - host0
        return self.last_s

    def done(self, phase: str, seconds: float) -> float:
        """An operation of ``phase`` computed for ``seconds``; returns how long it took with the injected
        slowdown (what the trace records)."""
        if self.pace is not None:
            c0 = self.clock()
            self.pace("compute", seconds)
            seconds += self.clock() - c0
        if self.trace is not None:
            self.trace.computed(phase, seconds)
        self.last_s = seconds
        return seconds

    @contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        started = self.start()
        yield
        self.stop(phase, started)


def _stats(seconds: list[float]) -> list[Any]:
    """[count, median, minimum]: scheduling on a loaded host only ever lengthens an operation, so the shortest
    one of a step is the rank's speed; the median says how the step went."""
    if not seconds:
        return [0, None, None]
    return [len(seconds), round(statistics.median(seconds), 7), round(min(seconds), 7)]


def message_name(kind: str, pipeline: int, stage: int, micro_batch: int) -> str:
    """The same name on both ends of a message: what the sender produced (``F``: the activation of
    ``stage``, ``B``: the input gradient of ``stage``) for which micro-batch of which pipeline."""
    return f"{kind[0].upper()}{pipeline}.{stage}.{micro_batch}"
