"""The forward-backward dispatcher: what Megatron's ``get_forward_backward_func()`` returns under the
adaptor.

``train()`` looks the schedule function up once, before its loop, and passes that object to every
``train_step``; a job that must switch to rerouted or asymmetric execution mid-run therefore needs
the object it captured to decide *per call*. The dispatcher does: while no Odyssey runtime is active
(``--odyssey`` off, evaluation before training, tests) it calls Megatron's stock schedule for the
current ``parallel_state``; once a rank's runtime runs a plan it calls :class:`PlanSchedule`, which
executes this node's operations of that plan (1F1B, plus adopted micro-batches after a reroute, on
any stage split after a reconfiguration).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

from ..planning.plan import ExecutionPlan
from ..planning.schedule import Op, node_operations
from .evaluation import awaiting_the_losses_of_the_data_parallel_peers
from .hooks import STATE


@dataclass
class PlanSchedule:
    """A Megatron schedule function for one plan, as seen from one node."""

    plan: ExecutionPlan
    node: int
    runtime: Any = None  # rank.MegatronRank that owns the executor
    operations: list[Op] = field(init=False)

    def __post_init__(self) -> None:
        self.operations = node_operations(self.plan)[self.node]

    def __call__(self, *, forward_step_func: Callable[..., Any], forward_only: bool = False,
                 odyssey_step: int | None = None, data_iterator: Any = None, collect_non_loss_data: bool = False,
                 **_: Any) -> list[dict[str, Any]]:
        if self.runtime is None:
            raise RuntimeError("PlanSchedule called without an Odyssey runtime on this rank")
        if collect_non_loss_data:
            raise NotImplementedError("Odyssey evaluates the loss only after a failure: the script's "
                                      "process_non_loss_data_func / non_loss_data_func cannot run")
        if forward_only:  # evaluate(): one evaluation iteration over the plan (megatron_lm.evaluation)
            return self.runtime.run_evaluation(forward_step_func, data_iterator)
        step = odyssey_step if odyssey_step is not None else int(_current_iteration())
        return self.runtime.run_schedule(forward_step_func, step)


class ForwardBackwardDispatcher:
    """The object ``train()`` captures; resolves the schedule at every call (see module docstring)."""

    def __init__(self, stock: Callable[[], Callable[..., Any]]):
        self._stock = stock  # megatron's own get_forward_backward_func (with its arguments bound)

    def select(self) -> Callable[..., Any]:
        runtime, plan = STATE.runtime, STATE.plan
        if runtime is None or plan is None:
            return self._stock()
        current = getattr(runtime, "_plan_schedule", None)
        if current is None or current.plan is not plan:
            current = PlanSchedule(plan, runtime.node, runtime)
            runtime._plan_schedule = current
        return current

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        schedule = self.select()
        if isinstance(schedule, PlanSchedule):
            out = schedule(*args, **kwargs)
        else:
            kwargs.pop("odyssey_step", None)
            out = STATE.last_losses = schedule(*args, **kwargs)  # the commit guard reports the step's loss from it
        if kwargs.get("forward_only") and STATE.runtime is not None:
            awaiting_the_losses_of_the_data_parallel_peers(STATE.runtime)
        return out


def get_forward_backward_func(original: Callable[..., Callable[..., Any]]) -> Callable[..., Any]:
    """megatron's ``get_forward_backward_func``, returning a :class:`ForwardBackwardDispatcher`."""

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> ForwardBackwardDispatcher:
        return ForwardBackwardDispatcher(functools.partial(original, *args, **kwargs))

    return wrapper


def _current_iteration() -> int:
    from megatron.training.global_vars import get_args

    return get_args().curr_iteration
