"""A rank blocked in a gloo collective with a failed rank that lives on leaves it once the agent aborts the generation
for that failure (``megatron_lm.rank.AbortWatcher``): three real gloo processes, the third alive and out of the
collective, as a rank cut off from the agent's machine only (the agent could not kill it) would be."""
from __future__ import annotations

import multiprocessing as mp
import queue
import time
from datetime import timedelta

import torch.distributed as dist

from megatron_odyssey.runtime.agent import free_port
from megatron_odyssey.runtime.errors import failure_abort


def test_an_abort_for_failed_ranks_shuts_the_survivors_gloo_connections_and_a_re_plan_does_not() -> None:
    """A re-plan's abort leaves the all-reduce waiting (its ranks finish the step in flight: the abort must not cut a
    collective between steps); the abort for rank 2's failure makes ranks 0 and 1 leave it within seconds, with the
    error a broken connection raises (which they take for a peer's failure and recover from)."""
    from _runtime_workers import abort_shuts_gloo_worker

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=abort_shuts_gloo_worker, args=(r, port, out)) for r in range(3)]
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
    finally:
        store.set("done", "1")
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
