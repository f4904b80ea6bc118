"""Megatron-LM's own fault injector (``--fault-injector-*``, core_r0.18.0 on, with nvidia-resiliency-ext 0.6+)
under ``--odyssey``: compatible, so a job can be tested with the faults Megatron injects. (Also the one kind of
Odyssey's own injector that reaches into Megatron: ``kind=deadline``, :func:`reach_the_time_limit`.)

Its faults are real ones: a signal (SIGKILL, SIGTERM, SIGINT, SIGSTOP), a crash (SEGFAULT, OS_ABORT), a hang
with the GIL held (LOCK_GIL), an exception raised in the main thread at any moment (ASYNC_EXC, SIGNAL_EXC) or in
``train()``'s loop (WORKLOAD_EXC), a device error or a device hang (GPU_ERROR, GPU_SLEEP). Odyssey recovers from
each as from any failure: the agent sees the process end (and says on the terminal how it ended) or its
heartbeat stop. Until the first failure Megatron's injector runs as it is (its plan broadcast over the world, its
ranks the launch-time ranks).

After a failure two things differ, and :func:`setup_on_the_survivors` replaces ``setup_fault_injection`` for them:

- ``--fault-injector-delay-start-iteration N`` reached after a recovery: Megatron's injector would plan on the
  world's rank 0 and broadcast over the world, whose ranks are now the survivors', renumbered (a target rank
  would name another machine, or be out of range and raise on every rank). Here every survivor draws the same
  plan itself, with no collective a further failure could break: targets are launch-time ranks, ``--fault-
  injector-num-ranks`` picks among the live ones (but launch-time rank 0, as Megatron spares its rank 0), a
  named rank whose machine is gone gets nothing (said in the log), and without ``--fault-injector-seed`` the
  shared seed is the job's ``--seed`` and the iteration.
- A machine that comes back (``odyssey-launch --join``) enters ``train()`` when the job is long past its start:
  an injection timed from the start was set up by the job then, so the joining rank does not set one up again.
"""
from __future__ import annotations

import datetime
import functools
import logging
import random
from typing import Any, Callable

from ..planning.cluster import node_ranks
from .hooks import STATE

log = logging.getLogger(__name__)


def setup_on_the_survivors(original: Callable[..., Any]) -> Callable[..., Any]:
    """``megatron.core.fault_injector.setup_fault_injection`` (train() imports it when it runs)."""

    @functools.wraps(original)
    def setup_fault_injection(config: Any) -> Any:
        runtime = STATE.runtime
        if runtime is None or runtime.stock:
            return original(config)  # before any failure: Megatron's own, as it is
        from megatron.core import fault_injector

        if fault_injector.should_setup_fault_injection_at_start(config):
            log.warning(f"fault injector: rank {runtime.ident} joined the running job; the injection timed from "
                        f"the job's start was set up then, not again")
            return None
        live = node_ranks(sorted(runtime.rank_map.live_nodes), runtime.cfg.tp)
        plan = survivors_plan(config, live, runtime.cfg.nproc, _shared_seed(config, runtime))
        if plan is None:
            return None
        fault, delay, targets = plan
        if runtime.ident in targets:
            _dispatch(fault, delay, runtime.ident)
        return None

    return setup_fault_injection


def survivors_plan(config: Any, live: list[int], launch_world: int, seed: int) -> tuple[Any, float, list[int]] | None:
    """(fault, delay in s, live target ranks), drawn with Megatron's own ``get_fault``/``get_fault_delay`` from one
    seed every survivor shares; None when every named target's machine is gone."""
    from megatron.core import fault_injector

    rng = random.Random(seed)
    fault_injector.rng = rng  # get_fault / get_fault_delay draw from the module's generator
    if config.fault_injector_ranks is not None:
        named = [int(r) for r in str(config.fault_injector_ranks).split(",")]
        bad = [r for r in named if not 0 <= r < launch_world]
        if bad:
            raise ValueError(f"--fault-injector-ranks {config.fault_injector_ranks}: rank(s) {bad} are not in the job's "
                             f"launch-time world of {launch_world}")
        targets = [r for r in named if r in live]
        gone = [r for r in named if r not in live]
        if gone:
            log.warning(f"fault injector: rank(s) {gone} named by --fault-injector-ranks already failed; no fault "
                        f"for them")
    else:
        eligible = [r for r in live if r != 0]
        targets = rng.sample(eligible, k=min(int(config.fault_injector_num_ranks), len(eligible)))
    fault = fault_injector.get_fault(config)
    delay = fault_injector.get_fault_delay(config)
    return (fault, delay, targets) if targets else None


def _shared_seed(config: Any, runtime: Any) -> int:
    if config.fault_injector_seed is not None:
        return int(config.fault_injector_seed)
    return int(getattr(runtime.args, "seed", 0)) * 1_000_003 + int(runtime.current_step)


def _dispatch(fault: Any, delay: float, ident: int) -> None:
    from megatron.core.fault_injector import clear_workload_exception, dispatch_fault_injection  # nvrx's

    clear_workload_exception()
    now = datetime.datetime.now()
    log.warning(f"[{now:%Y-%m-%d %H:%M:%S.%f}] FAULT INJECTION: Rank {ident} will inject fault {fault.name} at "
                f"{now + datetime.timedelta(seconds=delay):%Y-%m-%d %H:%M:%S.%f}")
    dispatch_fault_injection(fault=fault, delay=delay, callback=None)


def reach_the_time_limit() -> None:
    """``--odyssey-inject-fault ...,kind=deadline``: this rank's clock of the job's start
    (``megatron.training.training._TRAIN_START_TIME``, which the exit check of ``checkpoint_and_decide_exit`` and
    ``evaluate`` measures ``--exit-duration-in-mins`` from, in every release) is set back by the limit, so the next
    check finds it passed, as a job that ran that long would; the check's all-reduce (MAX) tells every rank."""
    from megatron.training import training
    from megatron.training.global_vars import get_args

    limit_mins = get_args().exit_duration_in_mins
    if not limit_mins:
        raise RuntimeError("kind=deadline: --exit-duration-in-mins is not set (checked at start-up)")
    training._TRAIN_START_TIME -= limit_mins * 60.0
