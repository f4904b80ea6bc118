"""``--fp16``'s dynamic loss scale under the step commit.

Stock Megatron decides inside ``optimizer.step`` (``prepare_grads``) whether a step's gradients overflowed (a flag
all-reduced over its model-parallel group), updates its loss scaler at once and skips the update if they did.
Under Odyssey three things change:

- the decision is needed *before* the commit (generation 0 computes Megatron's own gradient norm there), while the
  scaler may change only *with* the committed step: a step redone after a failure starts from the scale it started
  with. :func:`deferred_scaler_updates` runs Megatron's ``prepare_grads`` with the scaler's updates recorded, and
  :func:`decided` hands the step the recorded decision and applies the updates as the step begins;
- after a failure Megatron's model-parallel group no longer spans the plan, and no collective may run after the
  commit: the plan-wide decision comes from the plan-wide gradient norm (a gradient holds an inf or a NaN exactly
  when the sum of squares does), and :func:`agreed_overflow` lets ``prepare_grads`` unscale locally and take it;
- a rebuilt stage's fresh optimizer starts from ``--initial-loss-scale``: the scaler's state moves with a rebuilt
  rank (:func:`scaler_states` / :func:`load_scaler_states`). A rank that joins a running job (``odyssey-launch
  --join``, a standby put to work) has trained nothing: :func:`hand_over` gives it the scalers' state and the
  learning-rate schedule's step count of a rank that trained (skipped iterations do not advance the schedule, so
  neither follows from the iteration it resumes at).

Only jobs whose optimizer has a loss scaler (``--fp16``) take any of these paths beyond a no-op.
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable, Iterator

import torch

from .hooks import sub_optimizers


def _scaled_optimizers(megatron_optimizer: Any) -> list[Any]:
    """The sub-optimizers with a loss scaler (none without ``--fp16``)."""
    return [o for o in sub_optimizers(megatron_optimizer) if getattr(o, "grad_scaler", None) is not None]


def scalers(megatron_optimizer: Any) -> list[Any]:
    return [o.grad_scaler for o in _scaled_optimizers(megatron_optimizer)]


def loss_scaled(megatron_optimizer: Any) -> bool:
    return bool(scalers(megatron_optimizer))


def backward_scale(megatron_optimizer: Any, replicas: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What a plan's last stage multiplies its normalised loss by before the backward: Megatron's loss scale (its
    ``grad_scale_func``) and generation 0's data-parallel size ``replicas``. A plan divides each micro-batch's loss
    by all M x DP micro-batches of the step, stock by a replica's M (and averages the replicas' gradients later),
    so with the factor every fp16 backward runs at stock's magnitudes and overflows exactly where stock's does;
    :func:`agreed_overflow` and :func:`unscaled_norm` take it out again. None without a loss scaler."""
    if not loss_scaled(megatron_optimizer):
        return None
    return functools.partial(_scale_loss, megatron_optimizer, replicas)


def _scale_loss(megatron_optimizer: Any, replicas: int, loss: torch.Tensor) -> torch.Tensor:
    return megatron_optimizer.scale_loss(loss * replicas)


def unscaled_norm(norm: float, megatron_optimizer: Any, replicas: int) -> float | None:
    """The plan-wide norm of the gradients a :func:`backward_scale`'d step left -> Megatron's figure (the norm of
    the unscaled ones), or None when the step overflowed (stock computes no norm then)."""
    if not loss_scaled(megatron_optimizer):
        return norm
    if not math.isfinite(norm):
        return None
    return norm / (float(megatron_optimizer.get_loss_scale()) * replicas)


@contextlib.contextmanager
def deferred_scaler_updates(megatron_optimizer: Any) -> Iterator[list[Callable[[], None]]]:
    """Megatron's own ``prepare_grads`` (its unscaling and its found-inf all-reduce) with every scaler update it
    makes recorded, not applied: the list yielded holds them, for :func:`decided` after the commit."""
    updates: list[Callable[[], None]] = []
    kept = scalers(megatron_optimizer)
    for scaler in kept:
        scaler.update = functools.partial(_record, updates, type(scaler).update.__get__(scaler))
    try:
        yield updates
    finally:
        for scaler in kept:
            scaler.__dict__.pop("update", None)


def _record(updates: list[Callable[[], None]], update: Callable[[bool], None], found_inf: bool) -> None:
    updates.append(functools.partial(update, found_inf))


@contextlib.contextmanager
def decided(megatron_optimizer: Any, found_inf: bool, updates: list[Callable[[], None]]) -> Iterator[None]:
    """Megatron's ``optimizer.step`` after a ``prepare_grads`` that already ran before the commit: the step's own
    call applies the recorded scaler updates and returns the decision (running it again would unscale twice
    where the main gradients alias the fp32 gradient buffers, and update the scaler twice)."""
    def prepare_grads() -> bool:
        for update in updates:
            update()
        updates.clear()
        return found_inf

    megatron_optimizer.prepare_grads = prepare_grads
    try:
        yield
    finally:
        megatron_optimizer.__dict__.pop("prepare_grads", None)


@contextlib.contextmanager
def agreed_overflow(megatron_optimizer: Any, found_inf: bool, replicas: int) -> Iterator[None]:
    """Megatron's ``prepare_grads`` after a failure: each sub-optimizer unscales its main gradients (by the loss
    scale and the :func:`backward_scale` factor ``replicas``), but takes the plan-wide decision agreed before the
    commit instead of all-reducing its own flag over a model-parallel group (no collective may run after the
    commit)."""
    scaled = _scaled_optimizers(megatron_optimizer)
    for opt in scaled:
        opt._unscale_main_grads_and_check_for_nan = functools.partial(_unscale_locally, opt, found_inf, replicas)
    try:
        yield
    finally:
        for opt in scaled:
            opt.__dict__.pop("_unscale_main_grads_and_check_for_nan", None)


@torch.no_grad()
def _unscale_locally(opt: Any, found_inf: bool, replicas: int) -> bool:
    """``MixedPrecisionOptimizer._unscale_main_grads_and_check_for_nan`` less its all-reduce. Stock multiplies each
    replica's gradients by 1 / DP before summing them, then by 1 / scale; here both factors come after the sum
    (the same result where DP is a power of two: scaling by one commutes with rounding)."""
    opt.found_inf.fill_(0.0)
    if not getattr(opt, "is_stub_optimizer", False):
        torch._amp_foreach_non_finite_check_and_unscale_(opt._collect_main_grad_data_for_unscaling(), opt.found_inf,
                                                        opt.grad_scaler.inv_scale / replicas)
    return found_inf


def scaler_states(megatron_optimizer: Any) -> list[dict[str, Any]]:
    """Each loss scaler's state, copied (kept across a rebuild; the optimizer holding it is about to go)."""
    return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.state_dict().items()}
            for s in scalers(megatron_optimizer)]


def load_scaler_states(megatron_optimizer: Any, states: list[dict[str, Any]] | None) -> None:
    """Into a rebuilt stage's fresh optimizer: the scalers' state as the last committed step left it."""
    for scaler, state in zip(scalers(megatron_optimizer), states or []):
        if state:
            scaler.load_state_dict(state)


def hand_over(megatron_optimizer: Any, scheduler: Any, src: int, receiving: bool, schedule_steps: int) -> None:
    """Into the ranks admitted into a generation (``receiving``): the loss scalers' state and the schedule's step
    count ``schedule_steps`` of generation rank ``src``, which trained. One broadcast over the generation's world,
    which every member joins (a small object: the scale, two counters per scaler and one count)."""
    import torch.distributed as dist

    held = [{"scalers": [{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
                         for state in scaler_states(megatron_optimizer)], "schedule_steps": int(schedule_steps)}]
    dist.broadcast_object_list(held, src=src)
    if receiving:
        load_scaler_states(megatron_optimizer, held[0]["scalers"])
        scheduler.num_steps = held[0]["schedule_steps"]
