"""Stand-ins for a rank or an agent in the agent's tests: real processes and real sockets in a known state.

A test that reads a process's state must not read it while the process is still starting: a Python process
that has printed its first line may still be running (state R) or reading modules from disk (state D) for a
while on a loaded machine, and the agent treats a running silent rank differently from a sleeping one. A test
that needs an address nobody answers must hold it: a port chosen free and then let go may be taken by another
test's store (a stopped process's store then holds the probe for seconds).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from megatron_odyssey.runtime.process_probe import sample


def start_sleeper(seconds: float = 60.0, timeout_s: float = 60.0) -> subprocess.Popen:
    """A process asleep for ``seconds`` (in its own session), returned once /proc says it sleeps (state S)."""
    proc = subprocess.Popen([sys.executable, "-c", f"import time; print('up', flush=True); time.sleep({seconds!r})"],
                            stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    if proc.stdout.readline() != b"up\n":
        proc.kill()
        raise RuntimeError(f"the sleeping process ended before it started (exit {proc.wait()})")
    deadline = time.monotonic() + timeout_s
    while (seen := sample(proc.pid)) is None or seen.state != "S":
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the sleeping process did not fall asleep within {timeout_s:g} s "
                               f"({seen.describe() if seen else 'gone'})")
        time.sleep(0.01)
    return proc


@contextmanager
def refusing_address() -> Iterator[tuple[str, int]]:
    """A local address that refuses every connection at once: bound (so no one else can take it), never listening."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()


def kill_all(pids: Iterable[int]) -> None:
    """SIGKILL each of ``pids``; one already gone is no error (a test's processes end on their own too)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
