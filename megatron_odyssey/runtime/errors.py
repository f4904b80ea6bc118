"""A rank's own error versus a peer's failure, and what each side does about it.

A *peer failure* (a dead, hung or aborted peer, or the agent aborting the generation) is recovered
from in-process. A *local error* (out of memory, a shape or device bug, an exception in the user's
code) is this rank's: it prints its traceback, publishes an error record for the agent, aborts its
groups (so peers fail fast) and exits; the agent recovers without it, and stops the job when the
same error (type and place) recurs on another rank, since that looks deterministic.

What torch 2.13 (CPU wheel) raises, measured with three gloo ranks (2026-11-23):

- a peer SIGKILLed, or a peer that aborts its groups (``pg.abort()``), while we are in a collective
  or a p2p op with it: plain ``RuntimeError`` ``[.../gloo/transport/tcp/pair.cc:553] Connection
  closed by peer [127.0.0.1]:PORT. This is typically caused by a remote worker crashing`` (~50 ms);
  a second op on the same group raises the same again;
- an op that waits on a peer that never comes, or an op on a group we aborted ourselves: plain
  ``RuntimeError`` ``[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for
  recv operation to complete`` (after the group's timeout);
- the store: ``DistStoreError`` (wait/get timeout) and ``DistNetworkError`` (server gone, connect
  timeout), both subclasses of ``torch.distributed.DistError`` (itself a ``RuntimeError``); NCCL
  errors are ``DistBackendError``.

So a type check alone misses every gloo data-plane failure: those are recognised by gloo's
transport messages, and as a last resort by the agent's abort key for the current generation
(once a generation is aborted, whatever breaks in it is taken for a consequence of that failure).
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import sysconfig
import time
import traceback
from dataclasses import asdict, dataclass
from collections.abc import Iterable
from typing import Any, Callable

#: What the agent writes into a commit or go key a rank may be waiting on when it aborts the generation
#: (and into the next plan key, as ``{"giveup": reason}``, when it stops the job): a rank's waits are
#: blocking, server-side waits on one key (``generation.wait_key``), so the agent wakes each waiter
#: instead of each polling.
ABORTED = b"aborted"
GIVEUP_KEY = "odyssey/giveup"  # the agent stopped the job; the value says why
# the agent's last stderr line when it ends a job; the launcher turns it into its one-line failure
STOP_LINE = "[odyssey agent] stopping the job: "
ERROR_KEY = "odyssey/error/{}"  # a rank's local error record (JSON of ErrorRecord)
STARTED_KEY = "odyssey/started/{}"  # a rank finished start-up (reached its first training step)
LOCAL_ERROR_EXIT = 13  # a rank exits with this after a local error
STOPPED_EXIT = 14  # a rank exits with this when the agent gave up on the job
#: the type of the record a rank leaves with when its main thread can no longer leave a collective (``stuck_call``)
STUCK_TYPE = "StuckInCollective"

# gloo's transport errors (plain RuntimeError); see the module docstring
_PEER_MESSAGES = ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "Connection refused",
                  "Broken pipe", "Timed out waiting", "pair closure")


def is_peer_failure(exc: BaseException, store: Any = None, gen: int | None = None) -> bool:
    """True when ``exc`` comes from communication with a failed or aborted peer (recover in-process),
    False when it is this rank's own error (report it and leave the job)."""
    import torch.distributed as dist

    from .generation import Abort

    if isinstance(exc, (Abort, dist.DistError)):
        return True
    if isinstance(exc, RuntimeError) and any(m in str(exc) for m in _PEER_MESSAGES):
        return True
    if store is not None and gen is not None:
        try:
            return bool(store.check([f"odyssey/gen{gen}/abort"]))
        except Exception:  # the agent's store is gone: the job is over either way
            return True
    return False


# -- where an error happened ------------------------------------------------------------------------

_STDLIB_DIRS = tuple(os.path.abspath(p) + os.sep for p in
                     {sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("platstdlib")} if p)


def _is_library(filename: str) -> bool:
    """Frames of Python itself or of torch: not where a bug of ours or the user's is."""
    import torch

    if filename.startswith("<"):
        return True
    path = os.path.abspath(filename)
    if path.startswith(os.path.dirname(os.path.abspath(torch.__file__)) + os.sep):
        return True
    return path.startswith(_STDLIB_DIRS) and "-packages" + os.sep not in path


def error_place(exc: BaseException) -> str:
    """``file:line in function`` of the innermost frame of ``exc``'s traceback in our code or the
    user's (Python's and torch's own frames are skipped); the file is shortened to its last three
    path parts, so the same bug reads the same on machines with different checkouts."""
    return _place(traceback.extract_tb(exc.__traceback__))


def _place(frames: traceback.StackSummary) -> str:
    chosen = next((f for f in reversed(frames) if not _is_library(f.filename)), frames[-1] if frames else None)
    if chosen is None:
        return "unknown"
    short = "/".join(os.path.abspath(chosen.filename).split(os.sep)[-3:])
    return f"{short}:{chosen.lineno} in {chosen.name}"


@dataclass
class ErrorRecord:
    """A rank's local error, as published to the agent."""

    rank: int
    type: str
    place: str
    message: str
    traceback: str
    where: str  # "start-up", "step 3", "recovery"
    time: float
    #: the rank's process failed (it cannot go on), not the code: the same on two ranks is no sign of a bug
    failure: bool = False

    @property
    def signature(self) -> tuple[str, str]:
        """Two errors with the same signature are the same bug."""
        return self.type, self.place

    @classmethod
    def of(cls, exc: BaseException, rank: int, where: str) -> "ErrorRecord":
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(rank, type(exc).__qualname__, error_place(exc), str(exc)[:2000], text[-20000:], where, time.time())

    @classmethod
    def stuck(cls, rank: int, where: str, why: str, frame: Any) -> "ErrorRecord":
        """A rank whose main thread can no longer leave the call it is in (``frame``): a failure of its process."""
        stack = traceback.extract_stack(frame)
        text = "Stack of the main thread (most recent call last):\n" + "".join(stack.format())
        return cls(rank, STUCK_TYPE, _place(stack), why[:2000], text[-20000:], where, time.time(), failure=True)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> "ErrorRecord":
        return cls(**json.loads(text))

    def headline(self) -> str:
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        return f"{self.type}: {first} ({self.place})"


def read_error(store: Any, rank: int) -> ErrorRecord | None:
    key = ERROR_KEY.format(rank)
    try:
        return ErrorRecord.from_json(store.get(key)) if store.check([key]) else None
    except Exception:
        return None


def fail_locally(store: Any, rank: int, exc: BaseException, where: str,
                 abort: Callable[[], None] | None = None) -> None:
    """This rank's own error: print the traceback, abort our groups (peers fail now, not after a
    timeout), publish the record for the agent, exit. Never returns."""
    record = ErrorRecord.of(exc, rank, where)
    print(f"[odyssey rank {rank}] {where}: local error, leaving the job\n{record.traceback}", file=sys.stderr, flush=True)
    try:
        (abort or _abort_groups)()
    except Exception:
        pass
    leave_with(store, rank, record)


def leave_with(store: Any, rank: int, record: ErrorRecord) -> None:
    """Publish ``record`` for the agent (its terminal shows it, wherever this rank runs) and exit. Never returns."""
    if store is not None:
        try:
            store.set(ERROR_KEY.format(rank), record.to_json())
            store.check([ERROR_KEY.format(rank)])  # a round trip: the record is in before we exit
        except Exception as e:  # the agent is gone: the traceback above is all there is
            print(f"[odyssey rank {rank}] could not report the error to the agent: {e}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(LOCAL_ERROR_EXIT)  # no atexit/destructors: a half-torn-down group could hang them


def _abort_groups() -> None:
    from .world import abort_all_groups

    abort_all_groups()


def failure_abort(failed: Iterable[int]) -> str:
    """The abort value of a generation that ranks failed in (``Agent.recover``; a re-plan's and a takeover's say
    something else)."""
    return f"ranks {sorted(failed)} failed"


def is_failure_abort(value: bytes | str) -> bool:
    """An abort for failed ranks: their collectives are over, and a rank blocked in one with them must leave it, even
    where the failed rank lives on, unreachable (``megatron_lm.rank.AbortWatcher``)."""
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    return text.startswith("ranks [") and text.endswith("] failed")


def giveup_reason(store: Any) -> str | None:
    """Why the agent stopped the job, or None while it goes on (also when its store is gone: the
    caller's own store error says so)."""
    try:
        return store.get(GIVEUP_KEY).decode() if store.check([GIVEUP_KEY]) else None
    except Exception:
        return None


def dump_stacks_on_signals(ask: int = signal.SIGUSR1) -> None:
    """A rank's Python stacks go to its log (stderr) when it crashes in native code (SIGSEGV, SIGABRT, SIGBUS,
    SIGFPE, SIGILL: the agent then shows them on the terminal) and when the agent asks (``ask``, the job's
    ``TrainConfig.stack_dump_signal``: a stuck rank before it is fenced)."""
    import faulthandler

    faulthandler.enable(all_threads=True)
    faulthandler.register(ask, all_threads=True)


def stop_now(rank: int, reason: str, code: int = STOPPED_EXIT) -> None:
    """Leave at once, with one line saying why (the agent gave up, or is gone). Never returns."""
    print(f"[odyssey rank {rank}] stopping: {reason}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


def exit_if_stopped(store: Any, rank: int) -> None:
    """Exit at once when the agent gave up on the job or its store is gone."""
    try:
        stopped = store.check([GIVEUP_KEY])
    except Exception as exc:
        stop_now(rank, f"the agent is gone ({type(exc).__name__}: {str(exc)[:120]})")
    if stopped:
        stop_now(rank, f"the agent stopped the job: {giveup_reason(store) or 'no reason given'}")


def rank_log_traceback(workdir: Any, rank: int) -> str:
    """The last traceback in ``rank``'s log in ``workdir`` (the launchers name logs ``rank{N}.log``)."""
    from pathlib import Path

    path = Path(workdir) / f"rank{rank}.log"
    if not path.exists():
        return f"(no log here: see rank {rank}'s log on its machine)"
    return last_traceback(path.read_text(errors="replace"))


#: the agent asks a rank on another machine for its stacks (``agent.Agent._dump_stacks``; value: the signal and a
#: fresh stamp): its launcher sends it the signal (``launch.node_agent``)
DUMP_STACKS_KEY = "odyssey/dump-stacks/{}"
#: the agent fenced the rank after asking for its stacks: the launcher holding its log shows them on the terminal
STACKS_ASKED_KEY = "odyssey/stacks-asked/{}"


def rank_log_stack(workdir: Any, rank: int) -> str | None:
    """The thread that received the last stack dump in ``rank``'s log in ``workdir`` (its main thread: where a rank
    the agent fenced for making no progress had stopped), or None without a log or a dump here."""
    from pathlib import Path

    path = Path(workdir) / f"rank{rank}.log"
    return last_stack_dump(path.read_text(errors="replace")) if path.exists() else None


def last_stack_dump(text: str) -> str | None:
    """The ``Current thread`` stack of the last faulthandler dump in a log (the thread the signal reached)."""
    lines = [_RANK_PREFIX.sub("", line) for line in text.rstrip().splitlines()]
    start = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith("Current thread 0x")), None)
    if start is None:
        return None
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("  ")), len(lines))
    return "\n".join(lines[start:end])


#: torch.distributed's excepthook prefixes every line of an uncaught exception with the rank
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")
#: where a Python traceback, or faulthandler's dump at a fatal signal (SIGSEGV, SIGABRT...), begins
_TRACE_STARTS = ("Traceback (most recent call last):", "Fatal Python error:")


def last_traceback(text: str, max_lines: int = 80) -> str:
    """The last Python traceback (or fatal-signal dump) in a log, or its last lines when there is none."""
    lines = [_RANK_PREFIX.sub("", line) for line in text.rstrip().splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith(_TRACE_STARTS)]
    chunk = lines[starts[-1]:] if starts else lines[-12:]
    if chunk and chunk[0].startswith("Fatal Python error:"):  # the crashed thread's stack, not every thread's
        current = next((i for i, line in enumerate(chunk) if line.startswith("Current thread")), None)
        if current is not None:
            end = next((i for i in range(current, len(chunk)) if not chunk[i].strip()), len(chunk))
            chunk = [chunk[0], *chunk[current:end], "(the other threads' stacks: in the log)"]
    if len(chunk) > max_lines:
        chunk = chunk[:10] + ["  ..."] + chunk[-(max_lines - 11):]
    return "\n".join(chunk)


def indented(text: str) -> str:
    """A rank's traceback or stack set under the terminal line that shows it."""
    return "  " + "\n  ".join(text.rstrip().splitlines())


def describe_exit(code: int) -> str:
    """How a process ended, from its exit status (``Popen.returncode``: negative for a signal)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
