"""A rank blocked in a gloo collective with a failed rank that lives on leaves it once the agent aborts the generation
for that failure (``megatron_lm.rank.AbortWatcher``): three real gloo processes, the third alive and out of the
collective, as a rank cut off from the agent's machine only (the agent could not kill it) would be."""
from __future__ import annotations

import multiprocessing as mp
import queue
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatron_odyssey.runtime.agent import free_port
from megatron_odyssey.runtime.errors import failure_abort


@pytest.mark.parametrize("world", ["gloo", "nccl"])
def test_an_abort_for_failed_ranks_shuts_the_survivors_gloo_connections_and_a_re_plan_does_not(world: str) -> None:
    """A re-plan's abort leaves the all-reduce waiting (its ranks finish the step in flight: the abort must not cut a
    collective between steps); the abort for rank 2's failure makes ranks 0 and 1 leave it within seconds, with the
    error a broken connection raises (which they take for a peer's failure and recover from). ``nccl``: a GPU job's
    ranks waiting in a gloo group beside their world (as in Megatron's gloo groups), which aborting closes no more."""
    from _runtime_workers import abort_shuts_gloo_worker

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=abort_shuts_gloo_worker, args=(r, port, out, world)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        store.wait(["entered/0", "entered/1"], timedelta(seconds=120))
        time.sleep(0.5)  # (inside the all-reduce by now)
        store.set("odyssey/gen0/abort", "re-plan: rebalance (a test's)")
        time.sleep(2.0)  # the watchers polled it many times over (every 50 ms)
        try:
            early = out.get(timeout=0.1)
        except queue.Empty:
            early = None
        assert early is None, early  # still waiting in the all-reduce
        store.set("generation 1", "1")
        time.sleep(0.5)
        store.set("failure abort at", repr(time.time()))
        store.set("odyssey/gen1/abort", failure_abort({2}))
        results = sorted(out.get(timeout=60) for _ in range(2))
        assert [(r, what) for r, what, _ in results] == [(0, "RuntimeError"), (1, "RuntimeError")], results
        assert all(after < 10.0 for _, _, after in results), results  # (the watcher polls every 50 ms)
        assert procs[2].is_alive()  # the "failed" rank lived on all along
        store.set("done", "1")
        for p in procs:
            p.join(30)
        # (out of the all-reduce for over a second, with the watcher's stuck check at 1 s: not taken for stuck)
        assert [p.exitcode for p in procs] == [0, 0, 0]
    finally:
        store.set("done", "1")
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("how", ["send", "work"])
def test_a_rank_stuck_in_a_gloo_send_after_its_connections_were_shut_leaves_with_a_record_that_says_why(how) -> None:
    """Gloo never wakes a send whose message sits in a connection's transmit queue when that connection closes
    (``runtime.stuck_call``): rank 0's send of 64 MB to rank 1, which stopped reading, stays inside ``dist.send``
    after the abort for rank 1's failure shut every connection (the group's timeout is 300 s). Its abort watcher finds
    the main thread in the same call 2 s on, publishes a record (a failure of the process: the agent does not stop
    the job when it recurs) and exits, so the job can recover without it at once. The same for a send whose Work
    handle is waited on outside torch.distributed (``work``: the wait has no frame of its own)."""
    from _runtime_workers import stuck_gloo_send_worker

    from megatron_odyssey.runtime.errors import LOCAL_ERROR_EXIT, read_error

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=stuck_gloo_send_worker, args=(r, port, 16 * 1024 * 1024, how)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        store.wait(["sending"], timedelta(seconds=120))
        time.sleep(1.0)  # (inside the send, the socket full)
        assert not store.check(["send returned"])
        aborted = time.monotonic()
        store.set("odyssey/gen0/abort", failure_abort({1}))
        procs[0].join(60)
        took = time.monotonic() - aborted
        assert procs[0].exitcode == LOCAL_ERROR_EXIT, procs[0].exitcode
        assert 2.0 <= took < 30.0, took
        assert not store.check(["send returned"])  # (gloo's bug is still there: the send never came back)
        record = read_error(store, 0)
        assert record is not None and record.failure and record.type == "StuckInCollective", record
        assert record.where == "step 3", record
        place = {"send": "torch.distributed's send (distributed_c10d.py:",
                 "work": "the wait() of a torch.distributed Work in stuck_gloo_send_worker (_runtime_workers.py:"}[how]
        assert record.message.startswith(f"the main thread is still inside {place}"), record.message
        assert "after the abort (ranks [1] failed) shut every connection of its gloo groups" in record.message
        innermost = {"send": ("distributed_c10d.py", "in send"), "work": ("_runtime_workers.py", "work.wait()")}[how]
        assert all(part in record.traceback.splitlines()[-1] + record.traceback.splitlines()[-2]
                   for part in innermost), record.traceback
    finally:
        store.set("done", "1")
        for p in procs:
            p.kill()
            p.join(30)


def test_a_send_whose_peer_stopped_before_posting_its_receive_is_woken_by_the_abort() -> None:
    """The other side of gloo's bug: gloo writes a message only to a receive the peer posted; until then the send
    is a pending notice, which a closing connection does wake. Rank 1 stops without posting its receive: rank 0's
    send of 64 MB raises within seconds of the abort that shut its connections, and its watcher leaves no record
    (it was not stuck). A fault that stops a peer meets the bug only when the peer had posted the receive
    (``test_megatron_lm.py::test_a_rank_that_gloo_holds_in_a_send_is_started_again_and_joins`` stops it there)."""
    from _runtime_workers import stuck_gloo_send_worker

    from megatron_odyssey.runtime.errors import read_error

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=stuck_gloo_send_worker, args=(r, port, 16 * 1024 * 1024, "send", False))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        store.wait(["sending"], timedelta(seconds=120))
        time.sleep(1.0)
        assert not store.check(["send returned"]) and not store.check(["send raised"])  # (waits for the receive)
        aborted = time.monotonic()
        store.set("odyssey/gen0/abort", failure_abort({1}))
        store.wait(["send raised"], timedelta(seconds=30))
        assert time.monotonic() - aborted < 10.0
        procs[0].join(30)
        assert procs[0].exitcode == 0, procs[0].exitcode
        assert read_error(store, 0) is None
    finally:
        store.set("done", "1")
        for p in procs:
            p.kill()
            p.join(30)
