"""Heartbeats with progress, and store threads that survive a store hiccup (runtime.liveness), over a
real TCPStore; the hiccup is a store client that fails its next calls, as one whose connection dropped."""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatron_odyssey.runtime.liveness import IDLE, WAITING, WORKING, Beat, Heartbeat, Progress


@pytest.fixture
def server():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield store


def _client(server) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=5))


class Hiccup:
    """Makes the next ``failures`` store clients' first call fail (a dropped connection), then connects."""

    def __init__(self, server, failures: int):
        self.server, self.failures, self.connects = server, failures, 0

    def __call__(self):
        self.connects += 1
        if self.failures > 0:
            self.failures -= 1
            raise ConnectionResetError("connection reset by peer")
        return _client(self.server)


def _wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_beat_carries_progress() -> None:
    progress = Progress()
    assert Beat.parse(progress.beat()).state == IDLE
    progress.mark(7, "grad-sync")
    beat = Beat.parse(progress.beat())
    assert (beat.count, beat.state, beat.step, beat.phase) == (1, WORKING, 7, "grad-sync")
    assert beat.since == progress.since <= beat.t
    progress.set_state(WAITING)
    assert Beat.parse(progress.beat()).state == WAITING
    assert Beat.parse(repr(123.5)).since == 123.5  # a bare time still parses


def test_beat_tells_where_a_rank_is_between_steps() -> None:
    """Inside step s a rank is at (s, 0); each stop of the loop after it moves it one on, whatever happens in
    between (an evaluation's forward marks keep its stop); the next step starts again from 0."""
    progress = Progress()

    def position() -> tuple[int, int]:
        return Beat.parse(progress.beat()).position

    progress.mark(4, "forward")
    assert position() == (4, 0)
    progress.rest(4, "between")
    assert position() == (4, 1) and Beat.parse(progress.beat()).phase == "between"
    progress.rest(4, "log")
    progress.mark(4, "eval")  # an evaluation after step 4
    progress.set_state(IDLE)
    assert position() == (4, 2)
    progress.rest(4, "save")
    assert position() == (4, 3)
    progress.mark(5, "data")
    assert position() == (5, 0) > (4, 3)
    progress.rest(6, "between")  # a rank with no operation of its own in step 6
    assert position() == (6, 1)
    assert Beat.parse("1.0 3 idle 4 log 0.5").position == (4, 0)  # a beat of a rank without stops


def test_a_main_thread_waiting_in_a_collective_is_seen_from_another_thread() -> None:
    """What a heartbeat thread reports between steps: real gloo collectives over two processes, the peer late. A
    Work's wait() is C++ with no frame of its own: the line that calls it on a named handle tells (a local, a
    ``__slots__`` field); a wait on anything else (a threading Event) is not a collective."""
    from _runtime_workers import in_collective_worker, on_two_gloo_ranks

    results = dict(on_two_gloo_ranks(in_collective_worker, 120))
    assert results == {"barrier": True, "all_gather_object": True, "work": True, "slotted work": True,
                       "event": False, "sleeping": False}


def test_heartbeat_retries_a_store_hiccup_and_says_so(server, capfd) -> None:
    hiccup = Hiccup(server, failures=3)
    beat = Heartbeat("127.0.0.1", server.port, 3, 0.02, grace_s=5.0, connect=hiccup)
    beat.start()
    try:
        assert _wait_for(lambda: server.check(["odyssey/hb/3"]))  # beating after the hiccup
        assert beat.is_alive() and beat.retries == 3
        first = Beat.parse(server.get("odyssey/hb/3")).t
        assert _wait_for(lambda: Beat.parse(server.get("odyssey/hb/3")).t > first)  # and still beating
    finally:
        beat.stop()
    err = capfd.readouterr().err
    assert "[odyssey rank 3] heartbeat: store error (ConnectionResetError: connection reset by peer); retrying" in err
    assert "heartbeat: the store answers again after" in err


def test_a_beat_after_a_store_error_is_not_said_to_be_late(server, capfd) -> None:
    """The first beat after a store error comes as long after the last one as the store took to answer again, which
    the thread has said already: it is not reported as a late beat too (that line blames a starved process or a held
    GIL, and sent readers of a takeover's logs after the wrong cause)."""
    lost_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    first = [_client(lost_store)]
    hiccup = Hiccup(server, failures=6)  # (then 6 more tries, 0.25 s apart: 1.5 s without a beat)
    beat = Heartbeat("127.0.0.1", server.port, 4, 0.25, grace_s=10.0,
                     connect=lambda: first.pop() if first else hiccup())
    beat.start()
    try:
        assert _wait_for(lambda: lost_store.check(["odyssey/hb/4"]))
        del lost_store  # (its server stops: the next beat fails)
        assert _wait_for(lambda: server.check(["odyssey/hb/4"]), 10)
        again = Beat.parse(server.get("odyssey/hb/4")).t
        assert _wait_for(lambda: Beat.parse(server.get("odyssey/hb/4")).t > again)
    finally:
        beat.stop()
    err = capfd.readouterr().err
    assert hiccup.connects == 7 and "heartbeat: the store answers again after" in err, err
    assert "late" not in err, err


def test_store_thread_gives_up_only_after_the_grace_period(server, capfd) -> None:
    lost = []

    class Watcher(Heartbeat):
        def lost(self, exc: BaseException) -> None:
            lost.append((time.monotonic(), exc))

    started = time.monotonic()
    watcher = Watcher("127.0.0.1", server.port, 5, 0.02, grace_s=0.5, connect=Hiccup(server, failures=10 ** 6))
    watcher.start()
    watcher.join(5)
    assert not watcher.is_alive() and len(lost) == 1
    assert lost[0][0] - started >= 0.5  # not at the first error
    assert "the store has been unreachable for" in capfd.readouterr().err
