"""Which nodes a launcher starts again after a rank left stuck in a collective (``runtime.stuck_restart``); the
launcher doing it with real processes: ``test_launch.py``."""
from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from megatron_odyssey.runtime.errors import ERROR_KEY, ErrorRecord
from megatron_odyssey.runtime.stuck_restart import StuckRestarts


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def _stuck(store: dist.TCPStore, rank: int) -> None:
    import sys

    time.sleep(0.01)  # (each record its own time, as each life's is)
    store.set(ERROR_KEY.format(rank), ErrorRecord.stuck(rank, "step 2", "a test's", sys._getframe()).to_json())


def test_a_node_comes_back_whole_once_every_rank_of_it_left_stuck_or_with_0() -> None:
    """Once per exit, and never for a record an earlier life left: a life that exits 13 without a record of its own
    (it could not write one) is not taken for stuck; a node is started again at most ``limit`` times."""
    store = _store()
    restarts = StuckRestarts(tp=2, limit=2)
    _stuck(store, 4)
    assert restarts.due(store, {4: 13, 5: None, 6: None, 7: None}) == ([], [])  # rank 5 still runs
    (node,), said = restarts.due(store, {4: 13, 5: 0, 6: None, 7: None})
    assert (node.node, node.ranks, sorted(node.stuck), node.time, said) == (2, [4, 5], [4], 1, [])
    assert restarts.due(store, {4: 13, 5: 0, 6: None, 7: None}) == ([], [])  # judged once
    restarts.lives_started(store, [4, 5])
    # the new lives: exit 13 with the earlier life's record only (it wrote none of its own) is no stuck exit
    assert restarts.due(store, {4: 13, 5: 0, 6: None, 7: None}) == ([], [])
    restarts.lives_started(store, [4, 5])
    _stuck(store, 5)
    (node,), _ = restarts.due(store, {4: 0, 5: 13, 6: None, 7: None})
    assert (node.ranks, sorted(node.stuck), node.time) == ([4, 5], [5], 2)
    restarts.lives_started(store, [4, 5])
    _stuck(store, 4)
    _stuck(store, 5)
    due, said = restarts.due(store, {4: 13, 5: 13, 6: None, 7: None})
    assert due == [] and said == ["rank(s) [4, 5] left stuck in a collective again; node 2 was started again 2 "
                                  "time(s) already (--stuck-restarts 2): the job goes on without it"]


def test_a_node_where_a_rank_ended_otherwise_or_the_job_stopped_stays_out() -> None:
    store = _store()
    restarts = StuckRestarts(tp=2)
    _stuck(store, 0)
    _stuck(store, 2)
    due, said = restarts.due(store, {0: 13, 1: -9, 2: 13, 3: 14})
    assert due == [] and said == ["rank(s) [0] left stuck in a collective, but node 0's rank(s) [1] ended otherwise "
                                  "(exit [-9]): not starting the node again"]  # (node 1: the agent stopped the job)
    # a rank with its own error (exit 13, another record) is no stuck rank
    store.set(ERROR_KEY.format(0), ErrorRecord(0, "ValueError", "x.py:1 in f", "bad", "", "step 2", time.time()).to_json())
    fresh = StuckRestarts(tp=2)
    assert fresh.due(store, {0: 13, 1: 0}) == ([], [])
    # a node split over machines (this machine holds one of its two ranks) is not started again here
    _stuck(store, 3)
    due, said = StuckRestarts(tp=2).due(store, {3: 13})
    assert due == [] and "node 1 is split over machines (only [3] here)" in said[0]
    # a joining machine's rank, whose earlier life (on the machine that was lost) left stuck
    earlier = StuckRestarts(tp=1, before={3: ErrorRecord.from_json(store.get(ERROR_KEY.format(3))).time})
    assert earlier.due(store, {3: 13}) == ([], [])


def test_a_node_fenced_while_its_machine_stood_still_comes_back_whole() -> None:
    """Ranks the agent fenced while this machine stood still (``paused``: how long) count as stuck ones do: a node
    whose ranks were all fenced so, or stuck, or ended with 0, is started again, and the terminal says why; a rank
    fenced otherwise (killed, -9, without a stand-still) still keeps its node out; the restarts count together."""
    store = _store()
    restarts = StuckRestarts(tp=2, limit=1)
    (node,), said = restarts.due(store, {2: -9, 3: -9}, paused={2: 12.4, 3: 12.4})
    assert (node.node, node.ranks, node.stuck, node.paused, node.time, said) == (1, [2, 3], {}, {2: 12.4, 3: 12.4},
                                                                                 1, [])
    assert node.describe() == ("rank(s) [2, 3] were fenced while this machine stood still for 12 s (paused whole, "
                               "as a VM paused by its host or a hung kernel: no process of it ran), for their silence "
                               "meanwhile; the machine goes on now: starting node 1's rank(s) [2, 3] again to join "
                               "the running job (restart 1)")
    restarts.lives_started(store, [2, 3])
    _stuck(store, 2)
    due, said = restarts.due(store, {2: 13, 3: -9}, paused={3: 6.0})
    assert due == [] and said == ["rank(s) [2] left stuck in a collective; rank(s) [3] were fenced while this machine "
                                  "stood still again; node 1 was started again 1 time(s) already (--stuck-restarts 1): "
                                  "the job goes on without it"]
    due, said = StuckRestarts(tp=2).due(store, {0: -9, 1: -9}, paused={0: 8.0})
    assert due == [] and said == ["rank(s) [0] were fenced while this machine stood still, but node 0's rank(s) [1] "
                                  "ended otherwise (exit [-9]): not starting the node again"]
