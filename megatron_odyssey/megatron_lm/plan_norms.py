"""The whole model's gradient norm, parameter norm and gradient zero count over any plan.

Megatron sums these over its uniform model-parallel group, which after a failure holds a part of a pipeline, or
of several. Here every unit (embedding, layer, output) is counted once, by the lowest live node holding it,
tensor-parallel duplicates once (by TP rank 0), and a tied output layer's copy of the word embeddings (marked
``shared``) not at all, as in Megatron; one SUM all-reduce over the world gives every rank the job's figure.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..planning.plan import ExecutionPlan
from ..runtime.grad_sync import unit_of


def unit_owners(plan: ExecutionPlan) -> dict[int, int]:
    """unit -> the node that counts it in the gradient norm (the lowest live node holding it)."""
    return {unit: min(nodes) for unit, nodes in plan.holders().items()}


def plan_grad_norm(named: list[tuple[str, torch.nn.Parameter]], owner: dict[int, int], node: int, tp_rank: int,
                   num_layers: int, device: Any) -> float:
    """L2 norm of the whole model's gradient for any plan: every unit is counted once, by the lowest
    live node holding it (and tensor-parallel duplicates once, by TP rank 0; a tied output layer's copy of
    the word embeddings, marked ``shared``, not at all, as in Megatron); one SUM all-reduce over
    the world. Replaces Megatron's norm over the uniform model-parallel group."""
    return _plan_norm(named, owner, node, tp_rank, num_layers, device, _gradient)


def plan_params_norm(named: list[tuple[str, torch.nn.Parameter]], owner: dict[int, int], node: int, tp_rank: int,
                     num_layers: int, device: Any) -> float:
    """L2 norm of the whole model's parameters for any plan, counted as :func:`plan_grad_norm` counts gradients:
    what ``--log-params-norm`` prints (Megatron's ``calc_params_l2_norm`` sums over the uniform model-parallel
    group, which after a failure holds a part of a pipeline, or of several). The fp32 main copy where the
    optimizer keeps one whole on the rank, as Megatron reads it."""
    return _plan_norm(named, owner, node, tp_rank, num_layers, device, _parameter)


def _gradient(p: torch.nn.Parameter) -> torch.Tensor | None:
    g = getattr(p, "main_grad", None)
    return p.grad if g is None else g


def _parameter(p: torch.nn.Parameter) -> torch.Tensor:
    main = getattr(p, "main_param", None)
    return main if main is not None and not getattr(p, "main_param_sharded", False) else p.data


def plan_zero_count(named: list[tuple[str, torch.nn.Parameter]], owner: dict[int, int], node: int, tp_rank: int,
                    num_layers: int, device: Any) -> float:
    """Zero entries of the whole model's gradient for any plan, each unit counted once as :func:`plan_grad_norm`
    counts it: what core_r0.12.0's chained optimizer logs at every step (its ``count_zeros_fp32`` sums over the
    uniform model-parallel group)."""
    return _plan_sum(named, owner, node, tp_rank, num_layers, device, _gradient,
                     lambda t: t.numel() - torch.count_nonzero(t))


def _plan_norm(named: list[tuple[str, torch.nn.Parameter]], owner: dict[int, int], node: int, tp_rank: int,
               num_layers: int, device: Any, of: Callable[[torch.nn.Parameter], torch.Tensor | None]) -> float:
    return math.sqrt(_plan_sum(named, owner, node, tp_rank, num_layers, device, of, lambda t: t.double().pow(2).sum()))


def _plan_sum(named: list[tuple[str, torch.nn.Parameter]], owner: dict[int, int], node: int, tp_rank: int,
              num_layers: int, device: Any, of: Callable[[torch.nn.Parameter], torch.Tensor | None],
              measure: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """``measure`` summed over the whole model, each unit by its owner: one SUM all-reduce over the world."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    total = torch.zeros(1, dtype=torch.float64, device=device)
    for name, p in named:
        t = of(p)
        if t is None or owner.get(unit_of(name, num_layers)) != node or getattr(p, "shared", False):
            continue
        if tp_rank == 0 or param_is_not_tensor_parallel_duplicate(p):
            total += measure(t.detach())
    dist.all_reduce(total)
    return float(total)
