"""Pipeline executor: runs this rank's operations of a plan (symmetric, rerouted or asymmetric).

The operation order comes from ``planning.schedule.node_operations``, the same order the estimator
plays. Receives block; sends are non-blocking and completed at the end of the step, and every
message carries a tag naming (kind, pipeline, stage, micro-batch), so a node that serves two
pipelines (rerouting) never confuses their tensors. Because every node's order is a sub-sequence
of one dependency-respecting global order, the step cannot deadlock.

The loss of each micro-batch is its token-loss sum divided by the number of loss tokens in the
whole global batch: the gradients of all micro-batches then simply add up to the global-batch
gradient, however the micro-batches are spread over pipelines.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import contextlib
from typing import Any, Callable, ContextManager, Mapping, Protocol

import torch
import torch.distributed as dist

from ..planning.plan import ExecutionPlan
from ..planning.schedule import FORWARD, Op, node_operations
from .world import PlanGroups


class StageRunner(Protocol):
    """One stage's model: hidden states out, or per-token loss [b, s] on the last stage."""

    is_first: bool
    is_last: bool

    def forward(self, batch: Mapping[str, torch.Tensor], input_tensor: torch.Tensor | None) -> torch.Tensor: ...


MicroBatchFn = Callable[[int, int], Mapping[str, torch.Tensor]]  # (step, global micro-batch) -> batch


@dataclass
class StepResult:
    loss_sum: float = 0.0  # sum of this rank's normalised micro-batch losses (last stage only)
    forward_s: float = 0.0
    backward_s: float = 0.0
    ops: int = 0


@dataclass
class PipelineExecutor:
    plan: ExecutionPlan
    groups: PlanGroups
    runner: StageRunner
    micro_batch: MicroBatchFn
    activation_shape: tuple[int, ...]  # [seq, micro-batch, hidden]
    dtype: torch.dtype = torch.float32
    # False: Megatron's default loss, each micro-batch's token mean weighted equally (1 / all
    # micro-batches); True: every token of the global batch weighs the same (--calculate-per-token-loss)
    per_token_loss: bool = True
    device: torch.device | str = "cpu"  # where activations arrive (the stage model's device)
    # kind ("forward"/"backward") -> context manager timing one op's compute, without its waits
    compute_timer: Callable[[str], ContextManager[Any]] | None = None
    _ops: list[Op] = field(init=False)
    _executor: dict[tuple[int, int, int], int] = field(init=False)

    def __post_init__(self) -> None:
        self._ops = node_operations(self.plan)[self.groups.node]
        self._executor = self.plan.executor()
        self._offsets = self.plan.micro_batch_offsets()
        self._max_stages = max(p.length for p in self.plan.pipelines)
        self._max_mbs = max(p.micro_batches for p in self.plan.pipelines)

    # -- addressing -------------------------------------------------------------------------------
    def _rank_of(self, pipeline: int, stage: int, micro_batch: int) -> int:
        node = self._executor.get((pipeline, stage, micro_batch), self.plan.pipelines[pipeline].stages[stage].node)
        return self.groups.rank_map.rank(node, self.groups.tp_rank)

    def _tag(self, kind: str, pipeline: int, stage: int, micro_batch: int) -> int:
        return ((pipeline * self._max_stages + stage) * self._max_mbs + micro_batch) * 2 + (kind == FORWARD)

    def _timed(self, kind: str) -> ContextManager[Any]:
        return self.compute_timer(kind) if self.compute_timer is not None else contextlib.nullcontext()

    # -- one step ---------------------------------------------------------------------------------
    def run_step(self, step: int, token_count: Callable[[], float],
                 on_op: Callable[[str], None] | None = None) -> StepResult:
        """Run this rank's operations of ``step``; ``on_op(kind)`` is called before each (fault injection).

        ``token_count()`` (loss tokens in the whole global batch) is asked for only if this rank runs
        last-stage work, so other ranks never read the whole global batch."""
        import time

        result = StepResult()
        tokens: float | None = None
        saved: dict[tuple[int, int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        pending: list[tuple[dist.Work, torch.Tensor]] = []
        for op in self._ops:
            key = (op.pipeline, op.stage, op.micro_batch)
            last_stage = op.stage == self.plan.pipelines[op.pipeline].length - 1
            if on_op is not None:
                on_op(op.kind)
            t0 = time.perf_counter()
            if op.kind == FORWARD:
                inp = None
                if op.stage > 0:
                    inp = torch.empty(self.activation_shape, dtype=self.dtype, device=self.device)
                    dist.recv(inp, src=self._rank_of(op.pipeline, op.stage - 1, op.micro_batch),
                              tag=self._tag(FORWARD, op.pipeline, op.stage - 1, op.micro_batch))
                    inp.requires_grad_()
                batch = self.micro_batch(step, self._offsets[op.pipeline] + op.micro_batch)
                with self._timed("forward"):
                    out = self.runner.forward(batch, inp)
                if last_stage:
                    mask = batch["loss_mask"].to(out.dtype)
                    if not self.per_token_loss:
                        out = (out.float() * mask).sum() / mask.sum() / self.plan.num_micro_batches
                    else:
                        if tokens is None:
                            tokens = token_count()
                        out = (out.float() * mask).sum() / tokens
                    result.loss_sum += float(out.detach())
                else:
                    send = out.detach().contiguous()
                    pending.append((dist.isend(send, dst=self._rank_of(op.pipeline, op.stage + 1, op.micro_batch),
                                               tag=self._tag(FORWARD, *key)), send))
                saved[key] = (inp, out)
                result.forward_s += time.perf_counter() - t0
            else:
                inp, out = saved.pop(key)
                grad = None
                if not last_stage:
                    grad = torch.empty(self.activation_shape, dtype=self.dtype, device=self.device)
                    dist.recv(grad, src=self._rank_of(op.pipeline, op.stage + 1, op.micro_batch),
                              tag=self._tag("B", op.pipeline, op.stage + 1, op.micro_batch))
                with self._timed("backward"):
                    torch.autograd.backward(out, grad)
                if inp is not None:
                    send = inp.grad.contiguous()
                    pending.append((dist.isend(send, dst=self._rank_of(op.pipeline, op.stage - 1, op.micro_batch),
                                               tag=self._tag("B", *key)), send))
                result.backward_s += time.perf_counter() - t0
            result.ops += 1
        for work, _ in pending:
            work.wait()
        return result
