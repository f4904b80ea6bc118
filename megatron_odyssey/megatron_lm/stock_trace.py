"""Megatron's own pipeline messages, noted for the diagnosis before a Megatron-LM job's first failure.

Until then Megatron's 1F1B moves the activations and their gradients (``p2p_communication._communicate``),
so the agent's C4D link matrix (``runtime.diagnosis``) needs them noted where Megatron sends and receives
them. Messages between a pair of ranks are matched in order (gloo and NCCL alike), so each end numbers
them: the k-th activation stage i sends to stage i+1 in a step is the k-th that stage i+1 receives from it,
whatever micro-batch or model chunk it carries; both ends then name it as the executor does
(``op_trace.message_name``). Megatron's gradient reduction is noted as one all-reduce per stage. Generation 0
is Megatron's uniform grid: node = stage x DP + replica.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..runtime.op_trace import ComputeTimer, OpTrace, message_name

#: (message kind, direction to its receiver) of what ``_communicate`` sends to the next and previous stage
_SENT = (("forward", +1, "tensor_send_next"), ("backward", -1, "tensor_send_prev"))
#: (message kind, direction to its sender) of what ``_communicate`` receives from the previous and next stage
_RECEIVED = (("forward", -1, "recv_prev"), ("backward", +1, "recv_next"))


@dataclass
class StockMessages:
    node: int
    pp: int
    dp: int
    # generation 0's compute timer: its trace gets the messages too, its pace holds them back under an
    # injected slow link, by the compute that produced them
    timer: ComputeTimer
    sent: Counter = field(default_factory=Counter)
    received: Counter = field(default_factory=Counter)

    @property
    def stage(self) -> int:
        return self.node // self.dp

    @property
    def replica(self) -> int:
        return self.node % self.dp

    @property
    def trace(self) -> OpTrace | None:
        return self.timer.trace

    def begin(self, step: int) -> None:
        """A new step: a new record, messages numbered from 0 again."""
        if self.trace is not None:
            self.trace.begin(step)
        self.sent.clear()
        self.received.clear()

    def _neighbour(self, direction: int) -> tuple[int, int]:
        """(stage, node) of the next (+1) or previous (-1) stage of this replica (a ring: the interleaved
        schedule's last stage sends on to the first)."""
        stage = (self.stage + direction) % self.pp
        return stage, stage * self.dp + self.replica

    def sending(self, call: dict[str, Any]) -> None:
        """Before ``_communicate(**call)``: note what it hands over, then hold it back as a slow link would."""
        now, any_sent = time.time(), False
        for kind, direction, arg in _SENT:
            if call.get(arg) is not None:
                any_sent = True
                k = self.sent[kind]
                self.sent[kind] += 1
                if self.trace is not None:
                    self.trace.sent(self._neighbour(direction)[1], message_name(kind, self.replica, self.stage, k), now)
        if any_sent and self.timer.pace is not None:
            self.timer.pace("send", self.timer.last_s)

    def all_reduced(self, entered: float, left: float) -> None:
        """Megatron's gradient reduction of this step (``finalize_model_grads``: the stage's data-parallel
        all-reduce, whole buckets), noted as unit ``-1 - stage`` so that only the stage's data-parallel peers
        are compared (the last of them to enter held the others up)."""
        if self.trace is not None:
            self.trace.all_reduced(-1 - self.stage, entered, left)

    def received_all(self, call: dict[str, Any], entered: float, done: float,
                     waited: bool = True) -> dict[str, tuple[int, str]]:
        """After ``_communicate(**call)`` waited for its messages (from ``entered`` to ``done``). Messages it
        only posted (the interleaved schedule's overlapped receives, ``--overlap-p2p-comm``, on by default with
        virtual stages) are returned as {request key: (source node, name)}, to be timed when the schedule waits
        for them (:class:`TimedReceive`)."""
        posted: dict[str, tuple[int, str]] = {}
        for kind, direction, arg in _RECEIVED:
            if call.get(arg):
                k = self.received[kind]
                self.received[kind] += 1
                stage, node = self._neighbour(direction)
                name = message_name(kind, self.replica, stage, k)
                if waited:
                    if self.trace is not None:
                        self.trace.received(node, name, entered, done)
                else:
                    posted[arg] = (node, name)
        return posted


class TimedReceive:
    """A receive Megatron's overlapped schedule posted and waits for later: the wait is what the diagnosis
    times (when the rank began to need the data, and when it had it), as for a receive that waits at once."""

    def __init__(self, request: Any, trace: OpTrace | None, node: int, name: str):
        self.request, self.trace, self.node, self.name = request, trace, node, name

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        entered = time.time()
        out = self.request.wait(*args, **kwargs)
        if self.trace is not None:
            self.trace.received(self.node, self.name, entered, time.time())
        return out

    def __getattr__(self, name: str) -> Any:  # is_completed() and the rest: the request's own
        return getattr(self.request, name)
