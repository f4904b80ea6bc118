"""Pipeline executor: runs this rank's operations of a plan (symmetric, rerouted or asymmetric).

The operation order comes from ``planning.schedule.node_operations``, the same order the estimator
plays. Receives block; sends are non-blocking and completed at the end of the step. Messages carry
no tags (NCCL and HCCL ignore them): a node takes each peer's messages in the order that peer sends
them (:class:`~.transport.Mailbox`), holding any that arrive before they are needed, so a node that
serves two pipelines (rerouting) never confuses their tensors whatever the backend. The step cannot
deadlock: a receive waits at most for a message its sender produces at an earlier fault-free slot
than the receiving operation's.

In a filled reroute (``ExecutionPlan.fill``) the backward of a deferred stage is two operations: B
computes the input gradient only (:func:`~.weight_grad.input_gradients_only`) and sends it at once;
W, later in the order, runs the weight-gradient GEMMs B left behind.

The loss of each micro-batch is its token-loss sum divided by the number of loss tokens in the
whole global batch: the gradients of all micro-batches then simply add up to the global-batch
gradient, however the micro-batches are spread over pipelines.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import functools
import time
from typing import Any, Callable, ContextManager, Mapping, Protocol

import torch

from ..planning.plan import ExecutionPlan
from ..planning.schedule import (BACKWARD, FORWARD, WEIGHT_GRAD, Op, deferred, node_operations, overlapped_nodes,
                                 receive_orders)
from .dropout_rng import set_micro_batch
from .liveness import communicating
from .op_trace import ComputeTimer, OpTrace, message_name
from .transport import Mailbox, P2P
from .weight_grad import DeferredWeightGrads, input_gradients_only
from .world import PlanGroups


class StageRunner(Protocol):
    """One stage's model: hidden states out, or per-token loss [b, s] on the last stage."""

    is_first: bool
    is_last: bool

    def forward(self, batch: Mapping[str, torch.Tensor], input_tensor: torch.Tensor | None) -> torch.Tensor: ...


MicroBatchFn = Callable[[int, int], Mapping[str, torch.Tensor]]  # (step, global micro-batch) -> batch

#: the ``--fail phase=`` each operation kind belongs to
PHASE_OF_OP = {FORWARD: "forward", BACKWARD: "backward", WEIGHT_GRAD: "weight-grad"}


@dataclass
class StepResult:
    loss_sum: float = 0.0  # sum of this rank's normalised micro-batch losses (last stage only)
    # (global micro-batch, fp32 sum of its token losses, its loss tokens) of each micro-batch ending here: how
    # Megatron-LM reports a step's loss (runtime.step_loss.committed_loss redoes its fp32 sums)
    loss_parts: list[tuple[int, float, float]] = field(default_factory=list)
    forward_s: float = 0.0
    backward_s: float = 0.0
    weight_grad_s: float = 0.0  # deferred W operations (filled reroutes)
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
    device: torch.device | str = "cpu"  # where activations arrive and batches go (the stage model's device)
    p2p: P2P = field(default_factory=P2P)
    trace: OpTrace | None = None  # this rank's operation record for the agent's diagnosis (op_trace)
    # fault injection's sustained slowdowns (faults.Injector.pace): ("compute", s) after an operation's compute
    # of s seconds, ("send", s) before the send it produced
    pace: Callable[[str, float], None] | None = None
    slowed: Callable[[], bool] | None = None  # ... and whether one is in force (faults.Injector.slowed)
    # around this rank's last gradient operation of a step, when it is a whole backward (not a filled reroute's
    # deferred B or W): the gradient sync's overlapped all-reduces start inside it (grad_sync.GradientSync)
    overlap: Callable[[], ContextManager[None]] | None = None
    # fp16's loss scaling (Megatron's ``config.grad_scale_func``): applied to a last stage's normalised loss
    # before its backward, as Megatron's ``backward_step`` does; the reported loss stays unscaled
    loss_scale: Callable[[torch.Tensor], torch.Tensor] | None = None
    _ops: list[Op] = field(init=False)
    _executor: dict[tuple[int, int, int], int] = field(init=False)

    def __post_init__(self) -> None:
        self._ops = node_operations(self.plan)[self.groups.node]
        self._deferred = deferred(self.plan)
        self._executor = self.plan.executor()
        self._offsets = self.plan.micro_batch_offsets()
        self._overlap_at = None  # index of the backward the gradient sync's all-reduces start inside
        if self.overlap is not None and self.groups.node in overlapped_nodes(self.plan):
            self._overlap_at = max(i for i, op in enumerate(self._ops) if op.kind == BACKWARD)
        self._timer = ComputeTimer.for_device(self.device, self.trace, self.pace, self.slowed)
        # no closure over self: a reference cycle would keep this executor, and with it the
        # generation's process groups and their sockets, alive after teardown (peers then wait)
        self._inbox = Mailbox(self.p2p, receive_orders(self.plan, self.groups.node),
                              functools.partial(_rank_of_node, self.groups.rank_map, self.groups.tp_rank),
                              functools.partial(_empty, self.activation_shape, self.dtype, torch.device(self.device)))
        self._forward_inbox: Mailbox | None = None  # forward-only passes (run_forward_only), made at the first

    # -- addressing -------------------------------------------------------------------------------
    def _node_of(self, pipeline: int, stage: int, micro_batch: int) -> int:
        return self._executor.get((pipeline, stage, micro_batch), self.plan.pipelines[pipeline].stages[stage].node)

    def _batch(self, step: int, pipeline: int, micro_batch: int) -> dict[str, torch.Tensor]:
        return self._on_device(self.micro_batch(step, self._offsets[pipeline] + micro_batch))

    def _on_device(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    @staticmethod
    def _loss_part(batch: Mapping[str, torch.Tensor], out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A last stage's micro-batch: (fp32 sum of its token losses, as Megatron reports it; its loss tokens)."""
        mask = batch["loss_mask"].to(out.dtype)
        return (out.float() * mask).sum(), mask.float().sum()

    # -- one step ---------------------------------------------------------------------------------
    def run_step(self, step: int, token_count: Callable[[], float],
                 on_op: Callable[[str], None] | None = None) -> StepResult:
        """Run this rank's operations of ``step``; ``on_op(phase)`` is called before each (fault injection,
        progress), with the operation's phase from :data:`PHASE_OF_OP`.

        ``token_count()`` (loss tokens in the whole global batch) is asked for only if this rank runs
        last-stage work, so other ranks never read the whole global batch."""
        result = StepResult()
        tokens: float | None = None
        saved: dict[tuple[int, int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        weight_grads: dict[tuple[int, int, int], DeferredWeightGrads] = {}  # B done, W to come
        pending: list = []
        loss_sum: torch.Tensor | None = None  # on the device: one host sync per step, not per micro-batch
        parts: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (global micro-batch, loss sum, tokens)
        self._inbox.reset()
        if self.trace is not None:
            self.trace.begin(step)
        for index, op in enumerate(self._ops):
            key = (op.pipeline, op.stage, op.micro_batch)
            last_stage = op.stage == self.plan.pipelines[op.pipeline].length - 1
            phase = PHASE_OF_OP[op.kind]
            if on_op is not None:
                on_op(phase)
            t0 = time.perf_counter()
            if op.kind == WEIGHT_GRAD:
                c0 = self._timer.start()
                weight_grads.pop(key).apply()
                self._timer.stop(phase, c0)
                result.weight_grad_s += time.perf_counter() - t0
            elif op.kind == FORWARD:
                inp = None
                if op.stage > 0:
                    src = self._node_of(op.pipeline, op.stage - 1, op.micro_batch)
                    inp = self._receive(src, (FORWARD, op.pipeline, op.stage - 1, op.micro_batch))
                    inp.requires_grad_()
                c0 = self._timer.start()  # (compute only: not the wait for its input)
                batch = self._batch(step, op.pipeline, op.micro_batch)
                set_micro_batch(step, self._offsets[op.pipeline] + op.micro_batch)  # keys dropout (dropout_rng)
                out = self.runner.forward(batch, inp)
                if last_stage:
                    summed, loss_tokens = self._loss_part(batch, out)
                    parts.append((self._offsets[op.pipeline] + op.micro_batch, summed.detach(), loss_tokens))
                    if not self.per_token_loss:
                        out = summed / loss_tokens / self.plan.num_micro_batches
                    else:
                        if tokens is None:
                            tokens = token_count()
                        out = summed / tokens
                    loss_sum = out.detach() if loss_sum is None else loss_sum + out.detach()
                    if self.loss_scale is not None:
                        out = self.loss_scale(out)
                    self._timer.stop(phase, c0)
                else:
                    compute_s = self._timer.stop(phase, c0)
                    # the wire carries self.dtype: under bf16, Megatron's Float16Module hands every stage's
                    # output back in fp32 (each rank is "the last pipeline stage" of its own parallel_state);
                    # the values are bf16's, so the cast is exact
                    pending.append(self._send(out.detach().to(self.dtype), (FORWARD, op.pipeline, op.stage,
                                                                           op.micro_batch), +1, compute_s))
                saved[key] = (inp, out)
                result.forward_s += time.perf_counter() - t0
            else:
                inp, out = saved.pop(key)
                grad = None
                if not last_stage:
                    src = self._node_of(op.pipeline, op.stage + 1, op.micro_batch)
                    grad = self._receive(src, (BACKWARD, op.pipeline, op.stage + 1, op.micro_batch))
                c0 = self._timer.start()
                grad = grad if grad is None else grad.to(out.dtype)
                if (op.pipeline, op.stage) in self._deferred:
                    with input_gradients_only() as weight_grads[key]:
                        torch.autograd.backward(out, grad)
                elif index == self._overlap_at:
                    with self.overlap():  # type: ignore[misc]
                        torch.autograd.backward(out, grad)
                else:
                    torch.autograd.backward(out, grad)
                compute_s = self._timer.stop(phase, c0)
                if inp is not None:
                    pending.append(self._send(inp.grad.to(self.dtype), (BACKWARD, op.pipeline, op.stage,
                                                                       op.micro_batch), -1, compute_s))
                result.backward_s += time.perf_counter() - t0
            result.ops += 1
        with communicating():
            for work in pending:
                work.wait()
        result.loss_sum = float(loss_sum) if loss_sum is not None else 0.0
        if parts:
            sums = torch.stack([torch.stack([n, t]) for _, n, t in parts]).tolist()
            result.loss_parts = [(j, n, t) for (j, _, _), (n, t) in zip(parts, sums)]
        return result

    def run_forward_only(self, micro_batch: MicroBatchFn, position: int) -> list[tuple[int, float, float]]:
        """This rank's forward operations of the plan over other data (an evaluation: Megatron's
        ``forward_only`` schedule): global micro-batch ``j`` is ``micro_batch(position, j)``. Returns the
        ``(j, fp32 loss sum, loss tokens)`` of each micro-batch ending here. Each sender's forward messages keep
        their order in the training schedule, so the pass cannot deadlock where the step cannot; it is neither
        timed nor traced (the diagnosis judges training steps)."""
        if self._forward_inbox is None:
            orders = {src: [m for m in msgs if m[0] == FORWARD]
                      for src, msgs in receive_orders(self.plan, self.groups.node).items()}
            self._forward_inbox = Mailbox(self.p2p, orders, self._inbox.rank_of, self._inbox.make_buffer)
        inbox, pending, parts = self._forward_inbox, [], []
        inbox.reset()
        with torch.no_grad():
            for op in self._ops:
                if op.kind != FORWARD:
                    continue
                j = self._offsets[op.pipeline] + op.micro_batch
                inp = None
                if op.stage > 0:
                    with communicating():
                        inp = inbox.receive(self._node_of(op.pipeline, op.stage - 1, op.micro_batch),
                                            (FORWARD, op.pipeline, op.stage - 1, op.micro_batch))
                batch = self._on_device(micro_batch(position, j))
                set_micro_batch(position, j)
                out = self.runner.forward(batch, inp)
                if op.stage == self.plan.pipelines[op.pipeline].length - 1:
                    parts.append((j, *self._loss_part(batch, out)))
                else:
                    dst = self._node_of(op.pipeline, op.stage + 1, op.micro_batch)
                    pending.append(self.p2p.isend(out.to(self.dtype), self.groups.rank_map.rank(dst, self.groups.tp_rank)))
        with communicating():
            for work in pending:
                work.wait()
        if not parts:
            return []
        sums = torch.stack([torch.stack([n, t]) for _, n, t in parts]).tolist()
        return [(j, n, t) for (j, _, _), (n, t) in zip(parts, sums)]

    # -- one operation's messages, timed for the diagnosis (op_trace; its compute: ComputeTimer) -------------
    def _receive(self, src: int, key: tuple[str, int, int, int]) -> torch.Tensor:
        """The message ``key`` from node ``src`` (when the wait began and ended go to the trace)."""
        entered = time.time()
        with communicating():
            tensor = self._inbox.receive(src, key)
        done = time.time()
        if self.trace is not None:
            self.trace.received(src, message_name(*key), entered, done)
        return tensor

    def _send(self, tensor: torch.Tensor, key: tuple[str, int, int, int], direction: int, compute_s: float) -> Any:
        """Post ``tensor`` (what ``key`` names) to the node of the next (+1) or previous (-1) stage."""
        pipeline, stage, micro_batch = key[1:]
        dst = self._node_of(pipeline, stage + direction, micro_batch)
        if self.trace is not None:
            self.trace.sent(dst, message_name(*key), time.time())
        if self.pace is not None:  # an injected slow link holds the message back after it was handed over
            with communicating():
                self.pace("send", compute_s)
        return self.p2p.isend(tensor, self.groups.rank_map.rank(dst, self.groups.tp_rank))


def _rank_of_node(rank_map: Any, tp_rank: int, node: int) -> int:
    return rank_map.rank(node, tp_rank)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, _key: Any) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)
