"""The guard of train()'s barrier before exiting (``between_steps._guard_the_next_world_barrier``), over a real
one-rank gloo world. The Megatron-LM jobs that kill a rank in it are in ``test_megatron_lm_versions.py``."""
from __future__ import annotations

import threading
from typing import Iterator

import pytest
import torch.distributed as dist

from megatron_odyssey.megatron_lm import between_steps
from megatron_odyssey.megatron_lm.hooks import STATE


class _Survivor:
    """This rank as the guard sees it: its first injection point at ``end`` meets a peer's failure."""

    ident, committed, gen = 0, 2, 0

    def __init__(self) -> None:
        self.points: list[str] = []
        self.recovered: list[str] = []

    def at_between_steps(self, phase: str) -> None:
        self.points.append(phase)
        if len(self.points) == 1:
            raise RuntimeError("Connection closed by peer")

    def recover_outside_step(self, exc: BaseException, where: str) -> bool:
        self.recovered.append(where)
        return True


@pytest.fixture
def world(gloo_world: None) -> Iterator[None]:
    """The session's one-rank gloo world, with torch's barrier and no runtime again afterwards."""
    stock = dist.barrier
    try:
        yield
    finally:
        dist.barrier = stock
        STATE.runtime = None


def test_the_next_world_barrier_is_recovered_from_once_then_torch_again(world: None) -> None:
    stock = dist.barrier
    STATE.runtime = rank = _Survivor()
    between_steps._guard_the_next_world_barrier("the barrier before exiting")
    between_steps._guard_the_next_world_barrier("the barrier before exiting")  # installed once
    assert dist.barrier is not stock
    dist.barrier(group=dist.new_group([0]))  # not the world's: passed through, the guard still waits
    helper = threading.Thread(target=dist.barrier)  # another thread's: passed through
    helper.start()
    helper.join()
    assert rank.points == [] and dist.barrier is not stock
    dist.barrier()  # the world's, from the main thread: guarded, recovered from, passed again
    assert rank.points == ["end", "end"]
    assert rank.recovered == ["the barrier before exiting after iteration 3"]
    assert dist.barrier is stock  # one call only


def test_an_exit_decided_guards_the_barrier_and_a_going_on_does_not(world: None) -> None:
    stock = dist.barrier
    STATE.runtime = _Survivor()
    STATE.runtime.points.append("exit")  # its failure is not met in the exit check below
    decide = between_steps.checkpoint_and_decide_exit(lambda *args: args[0])
    assert decide(False) is False and dist.barrier is stock
    assert decide(True) is True and dist.barrier is not stock
