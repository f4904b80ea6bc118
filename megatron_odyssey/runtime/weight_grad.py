"""Decoupled back-propagation for megatron-core's linear layers: B now, W later (ReCycle, zero-bubble).

A filled reroute (``ExecutionPlan.fill``) runs a micro-batch's backward in two operations. B is an
ordinary ``torch.autograd.backward`` through megatron-core's own modules, run inside
:func:`input_gradients_only`: there, megatron-core's linear layers
(``LinearWithGradAccumulationAndAsyncCommunication``, every GEMM with a weight: QKV, projection, MLP,
output layer) compute only the input gradient the previous stage waits for, and hand the weight
gradient's operands (the layer's input and its output gradient) to a :class:`DeferredWeightGrads`.
W is :meth:`DeferredWeightGrads.apply`: the weight-gradient GEMMs, accumulated where the autograd
path would have put them (``main_grad`` under Megatron's DDP, ``grad`` otherwise). Every other
parameter (norms, biases, the embedding) gets its gradient in B as usual: they are cheap.

Why not ``autograd.backward(..., inputs=params)`` for W: megatron-core's linear backward computes the
weight gradient whether autograd asks for it or not, so an ``inputs=``-restricted B would cost a
whole backward, and the W call would recompute every input gradient on its way to the weights.

The replacement (``linear_backward``) is registered in :mod:`megatron_odyssey.megatron_lm.patches`;
outside :func:`input_gradients_only` it is the original.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

LINEAR_BACKWARD = "megatron.core.tensor_parallel.layers:LinearWithGradAccumulationAndAsyncCommunication.backward"

_ACTIVE = threading.local()  # .stash: the DeferredWeightGrads collecting this thread's B


@dataclass
class _Pending:
    weight: torch.nn.Parameter
    grad_output: torch.Tensor  # [tokens, out]
    total_input: torch.Tensor  # [tokens, in] (all-gathered under sequence parallelism)


@dataclass
class DeferredWeightGrads:
    """The weight gradients one micro-batch's B left for its W."""

    pending: list[_Pending] = field(default_factory=list)
    later: list[Callable[[], None]] = field(default_factory=list)  # other deferred work (sleep mode)

    def apply(self) -> None:
        """W: the weight-gradient GEMMs, in the order B met the layers, then drop the operands."""
        for work in self.later:
            work()
        self.later.clear()
        with torch.no_grad():  # a gradient, not part of any graph
            for p in self.pending:
                grad = p.grad_output.t().matmul(p.total_input)
                target = getattr(p.weight, "main_grad", None)
                if target is not None:  # Megatron's DDP: its hook would have added param.grad here
                    target.add_(grad.to(target.dtype))
                elif p.weight.grad is None:
                    p.weight.grad = grad.to(p.weight.dtype)
                else:
                    p.weight.grad.add_(grad)
        self.pending.clear()


@contextlib.contextmanager
def input_gradients_only() -> Iterator[DeferredWeightGrads]:
    """Inside: megatron-core linear layers defer their weight gradients to the yielded stash."""
    ensure_installed()
    if getattr(_ACTIVE, "stash", None) is not None:
        raise RuntimeError("input_gradients_only() does not nest")
    stash = _ACTIVE.stash = DeferredWeightGrads()
    try:
        yield stash
    finally:
        _ACTIVE.stash = None


def active() -> DeferredWeightGrads | None:
    """The stash of the B running on this thread, if any (for stages with their own weight gradients)."""
    return getattr(_ACTIVE, "stash", None)


def linear_backward(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch factory for ``LinearWithGradAccumulationAndAsyncCommunication.backward``."""
    num_inputs = len(inspect.signature(_linear_function().forward).parameters) - 1  # one gradient each, no ctx

    @functools.wraps(original)
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        stash = getattr(_ACTIVE, "stash", None)
        if stash is None or getattr(ctx, "grad_output_buffer", None) is not None:
            return original(ctx, grad_output)  # (Megatron's own embedding-wgrad deferral: leave it)
        inp, weight = ctx.saved_tensors
        inp = inp.detach()  # W's operand, kept past this graph (saved activations carry requires_grad)
        tp_group = getattr(ctx, "tp_group", None)
        total_input = inp
        if ctx.sequence_parallel:
            gathered = list(inp.size())
            gathered[0] *= dist.get_world_size(tp_group)
            total_input = torch.empty(gathered, dtype=inp.dtype, device=inp.device)
            dist.all_gather_into_tensor(total_input, inp.contiguous(), group=tp_group)
        grad_input = grad_output.matmul(weight)
        if ctx.sequence_parallel:
            scattered = torch.empty(inp.size(), dtype=inp.dtype, device=inp.device)
            dist.reduce_scatter_tensor(scattered, grad_input.contiguous(), group=tp_group)
            grad_input = scattered
        elif ctx.allreduce_dgrad:
            dist.all_reduce(grad_input, group=tp_group)
        go2 = grad_output.detach().reshape(-1, grad_output.shape[-1])
        stash.pending.append(_Pending(weight, go2, total_input.reshape(-1, total_input.shape[-1])))
        grad_bias = go2.sum(dim=0) if ctx.use_bias else None
        return (grad_input, None, grad_bias) + (None,) * (num_inputs - 3)

    return backward


def _linear_function() -> Any:
    from megatron.core.tensor_parallel.layers import LinearWithGradAccumulationAndAsyncCommunication

    return LinearWithGradAccumulationAndAsyncCommunication


def ensure_installed() -> None:
    """The patch, for hosts that do not import the Megatron-LM adaptor (the standalone trainer). Runs
    at every B, so the installed case is one attribute lookup, not a pass over the registry."""
    from ..megatron_lm.hooks import ORIGINAL_ATTR

    if hasattr(_linear_function().backward, ORIGINAL_ATTR):
        return
    from ..megatron_lm.patches import apply_patches

    status = apply_patches(only=[LINEAR_BACKWARD])[LINEAR_BACKWARD]
    if status != "applied":
        raise RuntimeError(f"cannot defer weight gradients: {LINEAR_BACKWARD} could not be patched ({status})")
