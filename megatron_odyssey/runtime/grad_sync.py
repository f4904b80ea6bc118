"""Per-layer gradient synchronisation for any layout (replaces Megatron's bucketed DP all-reduce).

Each weight-holding unit (embedding, transformer layer, output layer) is all-reduced among exactly
the ranks holding it, in the rounds the restorer's graph colouring gives: the units of one round
live on disjoint ranks, so their all-reduces run side by side, and every rank walks the rounds in
the same order, so two ranks sharing several units always meet in the same order. The executor
normalises the loss by the global batch's token count, so a plain SUM yields the global-batch
gradient whatever the number of micro-batches each pipeline processed.

Overlapped (``--overlap-grad-reduce``, where the plan allows: the rank's last gradient operation is a whole
backward, not a filled reroute's deferred W), each unit's all-reduce starts during that last backward, as
soon as every parameter of the unit has its gradient for the step, while the backward goes on through the
layers below (as Megatron's DDP starts a bucket's reduction). Every rank starts its units in one global
order, highest unit first (the order a backward pass finishes them in): two ranks sharing units issue
their collectives in the same order, so NCCL communicators cannot wait on each other in a cycle. The sums
are the same collectives over the same buffers as without overlap, so the result is bit for bit the same.

Tied embeddings (Megatron-LM without ``--untie-embeddings-and-output-weights``): the word embeddings and the
output layer are one weight, a copy of it on every stage holding either end (one parameter on a stage holding
both). Its gradient is the sum of every copy's, so it leaves its units' all-reduces and is summed, after them,
over every holder of either end (``PlanGroups.tied_group``): each copy then takes the same step.
"""
from __future__ import annotations

import contextlib
import functools
import re
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

from ..planning.plan import ExecutionPlan
from ..planning.restorer import colour_units
from .liveness import communicating
from .world import PlanGroups

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def unit_of(global_name: str, num_layers: int) -> int:
    """Unit index of a parameter's global name: 0 embedding, 1..L layers, L+1 output."""
    if global_name.startswith("embedding."):
        return 0
    m = _LAYER.match(global_name)
    if m:
        return int(m.group(1)) + 1
    return num_layers + 1  # final norm and output layer travel together


def params_by_unit(named_params: Iterable[tuple[str, torch.nn.Parameter]], num_layers: int) -> dict[int, list[torch.nn.Parameter]]:
    out: dict[int, list[torch.nn.Parameter]] = defaultdict(list)
    for name, p in named_params:
        out[unit_of(name, num_layers)].append(p)
    return dict(out)


@dataclass
class _InFlight:
    """A flat SUM all-reduce started and not yet waited for."""

    tensors: list[torch.Tensor]
    flat: torch.Tensor  # the concatenated inputs (where the result goes)
    wire: torch.Tensor  # what the collective reduces: ``flat``, or its host copy (staged)
    work: Any  # torch.distributed's Work handle
    entered: float

    def finish(self) -> list[torch.Tensor]:
        """Wait; views of the reduced buffer shaped like each input."""
        self.work.wait()
        if self.wire is not self.flat:
            self.flat.copy_(self.wire)
        out, offset = [], 0
        for t in self.tensors:
            out.append(self.flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
        return out


def start_all_reduce_flat(tensors: list[torch.Tensor], group: dist.ProcessGroup | None,
                          staged: bool = False) -> _InFlight:
    """Start a SUM all-reduce of ``tensors`` as one flat buffer (one collective, not one per tensor).
    ``staged``: reduce a host copy (device tensors over gloo, ranks sharing a device: gloo's CUDA
    collectives end the process in std::terminate when a failure tears their group down mid-operation,
    seen on an H100)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    wire = flat.cpu() if staged and flat.device.type != "cpu" else flat
    entered = time.time()
    return _InFlight(tensors, flat, wire, dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=group, async_op=True),
                     entered)


def all_reduce_flat(tensors: list[torch.Tensor], group: dist.ProcessGroup | None,
                    staged: bool = False) -> list[torch.Tensor]:
    """SUM-all-reduce ``tensors`` as one flat buffer; returns views of the reduced buffer shaped like each
    input (see :func:`start_all_reduce_flat`)."""
    return start_all_reduce_flat(tensors, group, staged).finish()


class GradientSync:
    def __init__(self, plan: ExecutionPlan, groups: PlanGroups, params: dict[int, list[torch.nn.Parameter]],
                 attr: str = "grad", staged: bool = False, trace: Any = None, overlap: bool = False,
                 tied: Iterable[torch.nn.Parameter] = ()):
        self.rounds, _, self.lower_bound = colour_units(plan)
        self.groups = groups
        self.tied = list(tied)  # this rank's copy of the tied embedding weight (see the module docstring)
        tied_ids = {id(p) for p in self.tied}
        self.params = {u: [p for p in ps if id(p) not in tied_ids] for u, ps in params.items()}
        self.params = {u: ps for u, ps in self.params.items() if ps}
        self.attr = attr  # "main_grad": Megatron DDP's fp32 gradient buffers, reduced in place
        self.staged = staged  # through host memory (see all_reduce_flat)
        self.trace = trace  # op_trace.OpTrace: when each all-reduce was entered and left (diagnosis)
        # overlap: this rank's shared units, highest first (the one order every rank starts them in)
        self.order = sorted((u for u in self.params if u in groups.unit_groups), reverse=True)
        self.overlap = overlap and bool(self.order)
        self._in_flight: dict[int, _InFlight] = {}
        self._next = 0  # index in ``order`` of the next unit to start
        self._armed = False
        self._waiting: dict[int, int] = {}  # unit -> parameters still to get their gradient in the armed backward
        self._fired: set[int] = set()
        self._hooks: list[Any] = []
        self._grad_accs: list[Any] = []
        if self.overlap:
            self._install_hooks()

    # -- overlap ------------------------------------------------------------------------------------
    def _install_hooks(self) -> None:
        """A post-hook on every shared parameter's gradient accumulator, registered after any the host
        installed (Megatron's DDP adds the gradient to ``main_grad`` in its own, which then runs first)."""
        me = weakref.ref(self)  # no cycle from the parameters back to the groups (see close)
        for unit in self.order:
            for p in self.params[unit]:
                if not p.requires_grad:
                    continue
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                self._grad_accs.append(acc)  # the node is cached only while referenced
                self._hooks.append(acc.register_hook(functools.partial(_param_ready, me, unit, id(p))))

    def close(self) -> None:
        """Remove the hooks (the parameters may outlive this generation's groups)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._grad_accs.clear()
        self._in_flight.clear()

    @contextlib.contextmanager
    def overlapping(self) -> Iterator[None]:
        """Around this rank's last backward of the step: start each unit's all-reduce once it is complete."""
        if not self.overlap:
            yield
            return
        self._in_flight.clear()
        self._next = 0
        self._fired.clear()
        self._waiting = {u: sum(1 for p in self.params[u] if p.requires_grad) for u in self.order}
        self._armed = True
        try:
            yield
        finally:
            self._armed = False

    def _ready(self, unit: int, param_id: int) -> None:
        if not self._armed or param_id in self._fired:
            return
        self._fired.add(param_id)
        self._waiting[unit] -= 1
        while self._next < len(self.order) and self._waiting[self.order[self._next]] == 0:
            self._start(self.order[self._next])
            self._next += 1

    def _start(self, unit: int) -> None:
        self._in_flight[unit] = self._start_sum(self.params[unit], self.groups.unit_groups[unit][0])

    def _start_sum(self, params: list[torch.nn.Parameter], group: Any) -> _InFlight:
        grads = [getattr(p, self.attr, None) for p in params]
        return start_all_reduce_flat([g if g is not None else torch.zeros_like(p) for g, p in zip(grads, params)],
                                     group, self.staged)

    def _finish(self, unit: int) -> None:
        self._finish_sum(self.params[unit], self._in_flight.pop(unit), unit)

    def _finish_sum(self, params: list[torch.nn.Parameter], flight: _InFlight, unit: int | None = None) -> None:
        with communicating():
            reduced = flight.finish()
        if self.trace is not None and unit is not None:
            self.trace.all_reduced(unit, flight.entered, time.time())
        for p, part in zip(params, reduced):
            self._store(p, part)

    def _store(self, p: torch.nn.Parameter, reduced: torch.Tensor) -> None:
        g = getattr(p, self.attr, None)
        if self.attr == "grad" or g is None:
            setattr(p, self.attr, reduced.clone())
        else:
            g.copy_(reduced)

    # -- the step's synchronisation ---------------------------------------------------------------------
    def __call__(self) -> int:
        """All-reduce this rank's shared units' gradients (finish those the backward started); returns the
        number of all-reduces joined."""
        if self.overlap:
            while self._next < len(self.order):  # not started in the backward (or no overlapped backward ran)
                self._start(self.order[self._next])
                self._next += 1
            for unit in self.order:
                self._finish(unit)
            self._next = 0
            return len(self.order) + self._sync_tied()
        joined = 0
        for round_units in self.rounds:  # the units of a round live on disjoint ranks: side by side
            for unit in round_units:
                if unit in self.groups.unit_groups and unit in self.params:
                    self._start(unit)
                    self._finish(unit)
                    joined += 1
        return joined + self._sync_tied()

    def _sync_tied(self) -> int:
        """Sum the tied weight's gradient over every copy (after every unit's all-reduce, on every member: one
        order for all)."""
        if self.groups.tied_group is None or not self.tied:
            return 0
        self._finish_sum(self.tied, self._start_sum(self.tied, self.groups.tied_group[0]))
        return 1


def _param_ready(sync: "weakref.ref[GradientSync]", unit: int, param_id: int, *_: Any) -> None:
    s = sync()
    if s is not None:
        s._ready(unit, param_id)
