"""A reproduction of gloo's send that a closed connection never wakes, for an upstream report (PyTorch / gloo).

Two CPU processes in one gloo group (timeout 60 s). Rank 1 posts a receive of 64 MiB and then stops (SIGSTOP):
alive, reading nothing. Rank 0 sends it 64 MiB: gloo writes what the two sockets take and waits for the rest. Then
rank 1 is killed (SIGKILL), so its connection closes. One expects rank 0's send to raise ("Connection closed by
peer"), as any gloo operation waiting on that peer does. It does not: it stays blocked until the group's timeout.

The contrast: rank 1 stopped *before* posting its receive. Gloo writes a message only to a posted receive; until then
the send is a notice and a pending send, which ``Pair::signalException`` wakes: the send raises at once. A send whose
message was already handed to the transmit queue holds an unbound buffer there, which that walk skips
(``gloo/transport/tcp/pair.cc``). Seen with torch 2.13.0; megatron-odyssey works around it
(``megatron_odyssey/runtime/stuck_call.py``).

    python scripts/gloo_send_not_woken.py        # prints both cases; exit 1 while the bug is there, 0 once fixed
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import sys
import time
from datetime import timedelta

MESSAGE_FLOATS = 16 * 1024 * 1024  # 64 MiB: larger than any socket's buffers
WAIT_S = 15.0  # how long after the peer's death the send is given to return or raise


def _rank(rank: int, port: int, posted: bool) -> None:
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore("group", store), rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    message = torch.zeros(MESSAGE_FLOATS)
    if rank == 1:
        if posted:
            dist.irecv(message, 0)
        store.set("receiving", "1")
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    store.wait(["receiving"])
    store.set("sending", "1")
    try:
        dist.send(message, 1)
        store.set("send ended", "returned")
    except RuntimeError as exc:
        store.set("send ended", f"raised {str(exc).splitlines()[0][:160]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def case(posted: bool) -> tuple[bool, str]:
    """(whether rank 0's send ended within ``WAIT_S`` of rank 1's death, what it did)."""
    import torch.distributed as dist

    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, port, posted)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        store.wait(["sending"], timedelta(seconds=120))
        time.sleep(1.0)  # (inside the send: the sockets full, or the notice sent)
        procs[1].kill()  # SIGKILL, stopped or not: its connections close
        died = time.monotonic()
        while time.monotonic() - died < WAIT_S:
            if store.check(["send ended"]):
                return True, f"{store.get('send ended').decode()} {time.monotonic() - died:.1f} s after the peer died"
            time.sleep(0.05)
        return False, f"still inside dist.send {WAIT_S:.0f} s after the peer died (it waits out the group's 60 s)"
    finally:
        for p in procs:
            p.kill()
            p.join(10)


def main() -> int:
    import torch

    print(f"torch {torch.__version__}")
    ended_before, said_before = case(posted=False)
    print(f"peer stopped before posting its receive: {said_before}")
    ended_after, said_after = case(posted=True)
    print(f"peer stopped after posting its receive:  {said_after}")
    return 0 if ended_after else 1


if __name__ == "__main__":
    sys.exit(main())
