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


class _Recovering:
    """A rank whose recovery moves it to the next generation (a new world, new process groups)."""

    ident, committed = 0, 2

    def __init__(self) -> None:
        self.gen = 0
        self.recovered: list[str] = []

    def at_between_steps(self, phase: str) -> None:
        pass

    def recover_outside_step(self, exc: BaseException, where: str) -> bool:
        self.recovered.append(where)
        self.gen += 1
        return True


def test_a_save_inside_save_checkpoint_and_time_is_redone_from_the_caller(capfd: pytest.CaptureFixture) -> None:
    """Megatron-LM 0.19's ``save_checkpoint_and_time`` reads the process groups off the model and passes them to
    ``save_checkpoint``. A peer's failure inside ``save_checkpoint`` is recovered from once, and the redo starts at
    the caller, which reads the new generation's groups; before, ``save_checkpoint`` was redone with generation 0's
    (groups that died with the old world: 'not initialized in the world group map'). Called alone and reading the
    groups itself (0.16's final save: ``group`` None), ``save_checkpoint`` still redoes itself."""
    runtime = _Recovering()
    saved: list[int] = []
    peer_dies = [True]

    @between_steps.guarded("save", "the checkpoint save", redone_by="save_checkpoint_and_time")
    def save_checkpoint(group: int | None) -> None:
        if group is not None and group != runtime.gen:
            raise RuntimeError(f"process group of generation {group} is not initialized in the world group map")
        if peer_dies and peer_dies.pop():
            raise RuntimeError("Connection closed by peer")
        saved.append(runtime.gen)

    @between_steps.guarded("save", "the checkpoint save")
    def save_checkpoint_and_time() -> None:
        save_checkpoint(runtime.gen)  # the groups of the model's pg_collection, as 0.19 reads them

    STATE.runtime = runtime
    try:
        save_checkpoint_and_time()
        assert saved == [1] and runtime.recovered == ["the checkpoint save after iteration 3"]
        assert between_steps.outside_guarded_calls()
        peer_dies.append(True)
        save_checkpoint(None)
        assert saved == [1, 2] and len(runtime.recovered) == 2 and between_steps.outside_guarded_calls()
    finally:
        STATE.runtime = None
    assert capfd.readouterr().err.count("the checkpoint save of iteration 3 was interrupted by a failure") == 2
