"""Per-layer gradient synchronisation for any layout (replaces Megatron's bucketed DP all-reduce).

Each weight-holding unit (embedding, transformer layer, output layer) is all-reduced among exactly
the ranks holding it, in the rounds the restorer's graph colouring gives: the units of one round
live on disjoint ranks, so their all-reduces run side by side, and every rank walks the rounds in
the same order, so two ranks sharing several units always meet in the same order. The executor
normalises the loss by the global batch's token count, so a plain SUM yields the global-batch
gradient whatever the number of micro-batches each pipeline processed.
"""
from __future__ import annotations

import re
import time
from collections import defaultdict
from typing import Any, Iterable

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


def all_reduce_flat(tensors: list[torch.Tensor], group: dist.ProcessGroup | None,
                    staged: bool = False) -> list[torch.Tensor]:
    """SUM-all-reduce ``tensors`` as one flat buffer (one collective, not one per tensor); returns views
    of the reduced buffer shaped like each input. ``staged``: reduce a host copy (device tensors over
    gloo, ranks sharing a device: gloo's CUDA collectives end the process in std::terminate when a
    failure tears their group down mid-operation, seen on an H100)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if staged and flat.device.type != "cpu":
        host = flat.cpu()
        dist.all_reduce(host, op=dist.ReduceOp.SUM, group=group)
        flat.copy_(host)
    else:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    out, offset = [], 0
    for t in tensors:
        out.append(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


class GradientSync:
    def __init__(self, plan: ExecutionPlan, groups: PlanGroups, params: dict[int, list[torch.nn.Parameter]],
                 attr: str = "grad", staged: bool = False, trace: Any = None):
        self.rounds, _, self.lower_bound = colour_units(plan)
        self.groups = groups
        self.params = params
        self.attr = attr  # "main_grad": Megatron DDP's fp32 gradient buffers, reduced in place
        self.staged = staged  # through host memory (see all_reduce_flat)
        self.trace = trace  # op_trace.OpTrace: when each all-reduce was entered and left (diagnosis)

    def __call__(self) -> int:
        """All-reduce this rank's shared units' gradients; returns the number of all-reduces joined."""
        joined = 0
        for round_units in self.rounds:
            for unit in round_units:
                entry = self.groups.unit_groups.get(unit)
                if entry is None or unit not in self.params:
                    continue
                group, _ = entry
                params = self.params[unit]
                grads = [getattr(p, self.attr, None) for p in params]
                entered = time.time()
                with communicating():
                    reduced = all_reduce_flat([g if g is not None else torch.zeros_like(p)
                                               for g, p in zip(grads, params)], group, self.staged)
                if self.trace is not None:
                    self.trace.all_reduced(unit, entered, time.time())
                for p, g, part in zip(params, grads, reduced):
                    if self.attr == "grad" or g is None:
                        setattr(p, self.attr, part.clone())
                    else:
                        g.copy_(part)
                joined += 1
        return joined
