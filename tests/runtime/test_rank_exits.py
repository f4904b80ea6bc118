"""How a rank left, judged without an agent: real processes and a real store, what each rank said before it left."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from datetime import timedelta

import pytest

dist = pytest.importorskip("torch.distributed")

from megatron_odyssey.launch import LocalRank  # noqa: E402
from megatron_odyssey.runtime.control_plane import DONE_KEY, LEAVING_KEY, free_port  # noqa: E402
from megatron_odyssey.runtime.rank_exits import RankExits  # noqa: E402
from megatron_odyssey.testing.processes import start_sleeper  # noqa: E402


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=10))


def exited(code: int) -> LocalRank:
    proc = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"], start_new_session=True)
    proc.wait(timeout=30)
    return LocalRank(proc)


def killed() -> LocalRank:
    proc = start_sleeper()
    proc.kill()
    proc.wait(timeout=30)
    return LocalRank(proc)


def exits_of(procs: dict[int, LocalRank], store, said: list[str], traceback: str = "") -> RankExits:
    return RankExits(procs, 1.0, said.append, said.append, lambda ident: traceback, store)


def test_a_rank_left_on_purpose_only_with_the_code_it_said(store) -> None:
    """Megatron-LM's rerun state machine: each rank says the code it leaves with (16, resume to disambiguate) before
    it exits. A rank that said nothing, or left with another code, did not leave on purpose."""
    said: list[str] = []
    exits = exits_of({0: exited(16), 1: exited(16), 2: exited(1)}, store, said)
    leaving = {"code": 16, "why": "the rerun state machine asks for a rerun"}
    assert not exits.left_on_purpose(0, 16)  # nothing said yet
    store.set(LEAVING_KEY.format(0), json.dumps(leaving))
    store.set(LEAVING_KEY.format(2), json.dumps(leaving))
    assert exits.left_on_purpose(0, 16) and exits.leaving == {0: leaving}
    assert not exits.left_on_purpose(2, 1)  # said 16, left with 1: a failure, not the script's decision
    assert not exits.left_on_purpose(1, 16)
    assert exits.left_on_purpose(2, None)  # silent but said it leaves with 16 (tearing down): not hung
    assert said == []


def test_a_finished_rank_is_killed_only_past_the_hard_timeout_and_counts_as_done(store) -> None:
    lingering = start_sleeper()
    try:
        said: list[str] = []
        exits = exits_of({0: LocalRank(lingering)}, store, said)
        assert not exits.finishing(0, 0.0) and 0 not in exits.exiting
        store.set(DONE_KEY.format(0), "1")
        assert exits.said_done(0)
        seen = exits.exiting[0]
        store.delete_key(DONE_KEY.format(0))
        assert exits.said_done(0)  # remembered from the first time it was seen
        assert exits.finishing(0, seen + 0.5) and lingering.poll() is None and not exits.killed_after_done
        assert exits.finishing(0, seen + 1.5)  # past the 1 s hard timeout
        assert lingering.wait(timeout=10) == -signal.SIGKILL and exits.killed_after_done == {0}
        assert said == ["rank 0 finished the job but has not exited for 1 s: killing it (its work is done: "
                        "not a failure)"]
        exits.replaced(0)  # a joiner takes rank 0: its old process's finish says nothing about the new one
        assert 0 not in exits.exiting
    finally:
        lingering.kill()


def test_how_a_rank_without_an_error_record_ended_goes_to_the_terminal(store) -> None:
    said: list[str] = []
    procs = {0: killed(), 1: exited(3), 2: exited(0)}
    exits = exits_of(procs, store, said, traceback="Traceback (most recent call last):\nValueError: boom\n")
    for ident in procs:
        exits.say_how_it_ended(ident)
    assert said[0] == ("rank 0 was killed by SIGKILL (it cannot leave a trace: the OOM killer, a scheduler, a person "
                       "or a fault injector sent it)")
    assert said[1] == ("rank 1 exited with code 3; the end of its log:\n"
                       "  Traceback (most recent call last):\n  ValueError: boom")
    assert len(said) == 2  # a clean exit says nothing
    exits.fenced(3, "missed heartbeats for 2.0 s")
    assert exits.endings_of({0, 1, 2, 3, 4}) == {0: "was killed by SIGKILL", 1: "exited with code 3",
                                                 3: "was fenced (SIGKILL): missed heartbeats for 2.0 s"}
