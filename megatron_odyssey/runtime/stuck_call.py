"""A rank whose main thread stays inside one torch.distributed call after its gloo connections were all shut.

Gloo (torch 2.13's) wakes an operation waiting on a connection that breaks only where the pair still lists it as
pending (``Pair::signalException`` walks the pair's bound buffers, its pending sends and receives, and the bound
buffers of its transmit queue). A send whose message was already handed to the transmit queue - a large message to a
peer that reads slowly - holds an *unbound* buffer there, which that walk skips, and the queue is dropped with the
connection. Its ``waitSend`` then lasts the group's whole timeout (Megatron's ``--distributed-timeout-minutes``, 10 by
default) though nothing can come: neither ``abort()`` nor shutting the sockets reaches it, and no Python code runs
in that thread until it ends. By the same code a receive whose message was partly read (its buffer is then the
pair's read operation's, not a pending receive's) is not woken either. Seen, as ``waitSend`` under
``gloo::allreduce`` (gdb), in DDP's gradient all-reduce and the rerun state machine's all-reduce when a firewall reset
the connections in the middle of a message (``tests/runtime/test_abort_watcher.py`` makes it with a peer that
stopped reading). Gloo writes a message only to a receive the peer has posted (until then the send is a pending
notice, which is woken): the peer stops after posting it, with the message larger than the sockets' buffers
(``test_megatron_lm.py::test_a_rank_that_gloo_holds_in_a_send_is_started_again_and_joins`` does so in Megatron's
pipeline send).

"Inside a call" is :func:`liveness.collective_frame`: a function of ``distributed_c10d`` (a blocking collective, a
coalesced handle's wait, as Megatron's overlapped gradient reduce waits), or a line ``<name>.wait()`` on a
torch.distributed Work, whose C++ wait makes no frame (this package's gradient sync, transport and state transfer
after the first recovery).

Nothing in-process ends that wait, so the rank leaves, and the job recovers without it at once instead of fencing it
at ``--odyssey-hard-timeout``. Once every connection is shut, no collective can still be making progress; a call that
returns or raises within ``after_s`` (a loop tick of gloo's, 10 ms, normally) is not stuck."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import FrameType

from .liveness import collective_frame, is_c10d_frame


@dataclass
class StuckCall:
    """Watches the main thread from the moment its connections were shut (one instance per shut)."""

    after_s: float  # how long one call may go on after the shut before it counts as stuck
    shut_at: float = field(default_factory=time.monotonic)
    frame: FrameType | None = None
    lasti: int = -1
    since: float = 0.0

    def stuck(self, now: float | None = None) -> FrameType | None:
        """The torch.distributed call the main thread has been inside, without moving, for ``after_s`` since the
        shut (None while it moves, or is not in one). The same frame object at the same instruction is the same
        call still going: a call made later, even at the same line, is another frame."""
        now = time.monotonic() if now is None else now
        frame = collective_frame()
        if frame is None:
            self.frame = None
            return None
        if frame is not self.frame or frame.f_lasti != self.lasti:
            self.frame, self.lasti, self.since = frame, frame.f_lasti, max(now, self.shut_at)
            return None
        return frame if now - self.since >= self.after_s else None

    def place(self, frame: FrameType) -> str:
        """The call :meth:`stuck` returned, for a message: torch.distributed's own function, or the line that waits
        on a Work handle."""
        at = f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"
        if is_c10d_frame(frame):
            return f"torch.distributed's {frame.f_code.co_name} ({at})"
        return f"the wait() of a torch.distributed Work in {frame.f_code.co_name} ({at})"

    def waited_s(self, now: float | None = None) -> float:
        """How long after the shut the main thread has been inside the call :meth:`stuck` returned."""
        return (time.monotonic() if now is None else now) - self.shut_at
