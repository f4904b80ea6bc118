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
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

MAX_MESSAGES = 256  # per step and direction: the summary stays small however many micro-batches run


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

    def begin(self, step: int) -> None:
        self.step = step
        self.forward_s.clear()
        self.backward_s.clear()
        self.sends.clear()
        self.recvs.clear()
        self.reductions.clear()
        self.sync_s = 0.0

    def computed(self, kind: str, seconds: float) -> None:
        (self.forward_s if kind == "forward" else self.backward_s).append(seconds)

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
        if not self.forward_s and not self.backward_s:
            return None
        out: dict[str, Any] = {
            "step": self.step, "node": self.node,
            # compute per micro-batch (what the diagnosis compares), and the forward and backward operations
            "c": round((sum(self.forward_s) + sum(self.backward_s)) / max(1, len(self.forward_s)), 7),
            "f": _stats(self.forward_s), "b": _stats(self.backward_s),
            "sync": round(self.sync_s, 6), "commit": round(self.commit_wait_s, 6),
            "tx": [[n, m, round(t, 6)] for n, m, t in self.sends],
            "rx": [[n, m, round(a, 6), round(b, 6)] for n, m, a, b in self.recvs],
            "ar": [[u, round(a, 6), round(b, 6)] for u, a, b in self.reductions],
        }
        return json.dumps(out, separators=(",", ":"))


def compute_clock(device: Any) -> Callable[[], float]:
    """What an operation's compute time is measured with. On the CPU the thread's CPU time: several ranks
    share few cores, and wall time would mostly measure whose turn it was (a rank descheduled mid-operation
    looks 3x slower; see docs/benchmarks.md, diagnosis); compute runs on the calling thread there
    (OMP_NUM_THREADS=1). On an accelerator kernels run asynchronously, so wall time between the host's
    calls measures the launches, not the kernels: a known gap (device events would close it)."""
    return time.thread_time if str(device).split(":")[0] == "cpu" else time.perf_counter


@dataclass
class ComputeTimer:
    """Times a rank's compute operations for its trace, and stretches them by an injected sustained slowdown
    (``faults.Injector.pace``). One object for both schedules that run a rank's compute: our executor, and
    Megatron's own 1F1B before a Megatron-LM job's first failure (``megatron_lm.hooks.timed_backward_step``)."""

    clock: Callable[[], float]
    trace: OpTrace | None = None
    pace: Callable[[str, float], None] | None = None
    last_s: float = 0.0  # the newest operation's (what a message it produced took to compute)

    def done(self, phase: str, seconds: float) -> float:
        """An operation of ``phase`` (forward/backward) computed for ``seconds``; returns how long it took
        with the injected slowdown (what the trace records)."""
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
        c0 = self.clock()
        yield
        self.done(phase, self.clock() - c0)


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
