"""The W&B hand-over's wait, against a real TCPStore (the job's store) and threads standing in for the other members;
the whole hand-over through real kills is test_megatron_lm.py's test_a_lost_machine_comes_back_and_joins."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatron_odyssey.megatron_lm.log_writers import HandOver


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def test_the_new_last_rank_waits_until_the_old_one_has_shut_its_writers(store: dist.TCPStore,
                                                                         capfd: pytest.CaptureFixture) -> None:
    """Rank 3 (new last) of generation 4, members 0-3: ranks 0 and 1 settle at once, rank 2 (the old last,
    finishing the run) half a second later; rank 3 goes on as soon as rank 2 has, well within its bound."""
    def member(ident: int, after_s: float) -> None:
        time.sleep(after_s)
        HandOver(4, ident, (0, 1, 2, 3), limit_s=30).settled(store)

    threads = [threading.Thread(target=member, args=(i, s)) for i, s in ((0, 0.0), (1, 0.0), (2, 0.5))]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    HandOver(4, 3, (0, 1, 2, 3), limit_s=30).wait_for_the_others(store)
    waited = time.monotonic() - t0
    for t in threads:
        t.join()
    assert 0.5 <= waited < 10, waited
    assert "did not shut" not in capfd.readouterr().err


def test_a_member_that_never_settles_is_named_and_waited_for_no_longer_than_the_bound(
        store: dist.TCPStore, capfd: pytest.CaptureFixture) -> None:
    """Rank 1 never settles (it died after the generation was formed): the new last rank waits its bound, 1 s,
    then resumes the run anyway, saying which rank it waited for. A settling of another generation does not count."""
    HandOver(2, 0, (0, 1, 2), limit_s=1).settled(store)
    HandOver(1, 1, (0, 1, 2), limit_s=1).settled(store)  # generation 1's, not 2's
    t0 = time.monotonic()
    HandOver(2, 2, (0, 1, 2), limit_s=1).wait_for_the_others(store)
    assert 1 <= time.monotonic() - t0 < 15  # (its bound, with room for a loaded machine; not forever)
    err = capfd.readouterr().err
    assert "[odyssey rank 2] generation 2: rank(s) [1] did not shut their W&B writer within 1 s" in err, err


def test_a_generation_of_one_does_not_wait(store: dist.TCPStore) -> None:
    t0 = time.monotonic()
    HandOver(7, 0, (0,), limit_s=30).wait_for_the_others(store)
    assert time.monotonic() - t0 < 15  # (not its 30 s bound)
