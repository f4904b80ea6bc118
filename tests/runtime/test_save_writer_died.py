"""A checkpoint writer process that dies during a save (runtime.liveness.SaveWriters): Megatron's dist-checkpointing
waits for every writer it forked through a joinable queue, so one that dies before it reports leaves its rank
waiting forever, and every peer in the save's collectives. Real gloo ranks, megatron-core's own save, writers that
really die; the rank's heartbeat thread finds the dead writer and the rank leaves with that cause, in seconds."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from _runtime_workers import save_writer_death_worker
from megatron_odyssey.runtime.control_plane import free_port
from megatron_odyssey.runtime.errors import LOCAL_ERROR_EXIT, read_error

WORLD = 2
BOUND_S = 300  # a hang is killed after this; a rank that sees its dead writer leaves within seconds


@pytest.mark.parametrize("case, how", [("no-psutil", "exit code 1"), ("killed", "killed by SIGKILL")])
def test_a_rank_whose_checkpoint_writer_died_leaves_saying_so(tmp_path, case: str, how: str) -> None:
    """A healthy save first (left alone: the ranks go on); then every writer of the second save dies at its start:
    each rank leaves with the dead writer named, instead of waiting forever."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30))
    ckpt = tmp_path / "ckpt"
    ranks = [mp.get_context("spawn").Process(target=save_writer_death_worker,
                                             args=(r, WORLD, str(tmp_path / "store"), port, str(ckpt), case))
             for r in range(WORLD)]
    for p in ranks:
        p.start()
    deadline = time.monotonic() + BOUND_S
    for p in ranks:
        p.join(max(0.0, deadline - time.monotonic()))
    codes = [p.exitcode for p in ranks]
    for p in ranks:  # each rank's group, as odyssey-launch kills it: what it started dies with it
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert codes == [LOCAL_ERROR_EXIT] * WORLD, codes  # (None: still waiting at the bound)
    for rank in range(WORLD):
        assert (ckpt / f"first-saved-{rank}").exists() and not (ckpt / f"second-saved-{rank}").exists()
        record = read_error(store, rank)
        assert record is not None and record.type == "CheckpointWriterDied", record
        assert f"({how}) during the save after step 1 before it reported" in record.message, record.message
        assert record.where == "the save after step 1"
