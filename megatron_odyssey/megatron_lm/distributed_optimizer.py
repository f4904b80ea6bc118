"""Megatron's distributed optimizer through a failure (``--use-distributed-optimizer`` with
``--num-distributed-optimizer-instances N``, N >= 2).

Before the first failure Megatron runs it as it is. Each stage's data-parallel ranks form N instances of
d/N consecutive ranks; an instance shards the stage's fp32 main weights and Adam moments over its ranks
(reduce-scatter inside the instance, then an all-reduce of each shard across instances), so every shard
lives on N ranks: in bf16 2 + 4 + 12 N / d bytes per parameter instead of 2 + 4 + 12 / d with one
instance, and 18 with the plain optimizer. With one instance a dead rank takes its shard with it, which
is why ``--odyssey`` asks for N >= 2 (:func:`shards_lost` says when a set of failures still loses one).

At a failure every rank keeps its own pieces (:func:`capture_pieces`, no collective: the generation's
groups are broken). In the next generation the live ranks that held the same stage and tensor-parallel
rank exchange them over a group of their own and each assembles its stage's full state
(:func:`reassemble`), from which the planner's transfers proceed as for the plain optimizer. Rebuilt
stages keep the state sharded (megatron-core 0.15+) in a layout of their own (an asymmetric plan holds each layer on a different
set of ranks, which Megatron's flat-buffer sharding over one data-parallel group cannot express): each
unit's state over the unit's holders, every shard on two of them (``replica_optimizer``); a failure in a
later generation is recovered from those pieces the same way, grouped by the units' live holders
(:func:`unit_holder_groups`).
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass
from itertools import chain
from typing import Any, Callable, Collection, Iterator

import torch
import torch.distributed as dist

from .hooks import sub_optimizers


class ShardLost(RuntimeError):
    """Every live holder of some part of a stage's distributed-optimizer state is dead."""


@dataclass
class Piece:
    """This rank's slice ``[start, end)`` of one flattened parameter's fp32 main value and Adam moments."""

    start: int
    end: int
    numel: int
    shape: tuple[int, ...]
    param: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: float


class ShardedState(dict):
    """name -> [:class:`Piece`, ...]: a rank's share of its stage's state; ``expected`` lists every parameter
    of the stage (name -> (numel, shape)), including those of which this rank holds no slice; ``plan`` is the
    layout of a rebuilt stage's replicated shards (None: generation 0's distributed optimizer)."""

    def __init__(self, expected: dict[str, tuple[int, tuple[int, ...]]], plan: Any = None):
        super().__init__()
        self.expected = expected
        self.plan = plan


def host_piece(start: int, end: int, model_param: torch.Tensor, value: torch.Tensor, state: Any) -> Piece:
    """Elements ``[start, end)`` of ``model_param``'s flattened state: host fp32 copies (they travel by pickling)
    of ``value`` and of the Adam moments in ``state`` (zeros before the first step)."""

    def host(t: torch.Tensor | None) -> torch.Tensor:
        return torch.zeros(end - start) if t is None else t.detach().reshape(-1).to("cpu", copy=True).float()

    return Piece(start, end, model_param.numel(), tuple(model_param.shape), host(value), host(state.get("exp_avg")),
                 host(state.get("exp_avg_sq")), float(state["step"]) if "step" in state else 0.0)


def distributed_optimizers(megatron_optimizer: Any) -> list[Any]:
    """The ``DistributedOptimizer`` instances inside a (possibly chained) Megatron optimizer."""
    return [opt for opt in sub_optimizers(megatron_optimizer) if hasattr(opt, "model_param_gbuf_map")]


def capture_pieces(named: list[tuple[str, torch.nn.Parameter]], megatron_optimizer: Any) -> ShardedState:
    """This rank's pieces of every parameter of its stage (host copies: they travel by pickling)."""
    name_of = {id(p): n for n, p in named}
    out = ShardedState({n: (p.numel(), tuple(p.shape)) for n, p in named})
    for opt in distributed_optimizers(megatron_optimizer):
        models = chain(opt.model_float16_groups, opt.model_fp32_groups)
        shards = chain(opt.shard_fp32_from_float16_groups, opt.shard_fp32_groups)
        for model_group, shard_group in zip(models, shards):
            for model_param, shard in zip(model_group, shard_group):
                span = opt._get_model_param_range_map(model_param)["param"]
                out[name_of[id(model_param)]] = [host_piece(span.start, span.end, model_param, shard,
                                                            opt.optimizer.state.get(shard, {}))]
    return out


def assemble(shares: list[ShardedState]) -> dict[str, dict[str, Any]]:
    """The full state (``runtime.state`` format) from the shares of the live ranks that held one stage."""
    expected = shares[0].expected
    pieces: dict[str, list[Piece]] = defaultdict(list)
    for share in shares:
        for name, held in share.items():
            pieces[name] += held
    out: dict[str, dict[str, Any]] = {}
    for name, (numel, shape) in expected.items():
        covered = torch.zeros(numel, dtype=torch.bool)
        full = {k: torch.zeros(numel) for k in ("param", "exp_avg", "exp_avg_sq")}
        steps = set()
        for piece in pieces.get(name, []):
            for key in full:
                full[key][piece.start:piece.end] = getattr(piece, key)
            covered[piece.start:piece.end] = True
            steps.add(piece.step)
        if not bool(covered.all()):
            missing = (~covered).nonzero().view(-1)
            raise ShardLost(f"{name}: elements {int(missing[0])}..{int(missing[-1])} of {numel} were held only by "
                            f"dead ranks (every distributed-optimizer instance lost its shard)")
        if len(steps) > 1:
            raise RuntimeError(f"{name}: the live shards disagree on the Adam step count {sorted(steps)}")
        out[name] = {**{k: v.view(shape) for k, v in full.items()}, "step": steps.pop() if steps else 0.0}
    return out


def reassemble(share: ShardedState, groups: list[list[int]], my_rank: int,
               parts: list[Callable[[str], bool]] | None = None,
               aliases: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Collective over the new world: one group per set of live ranks that kept pieces of the same
    parameters (a generation-0 stage's holders, per tensor-parallel rank; or, after a later generation, the
    holders of the same units: ``parts[i]`` says which names group ``i`` assembles), created by every rank
    in the same order; returns the full state of every parameter this rank kept pieces of. ``aliases``
    (name -> the name of the parameter it copies, ``state.TIED_ALIASES``): pieces kept under either name are
    one parameter's (tied embeddings), and come back under the name this rank has."""
    share, renamed = _canonical(share, aliases or {})
    mine = _reassemble(share, groups, my_rank, parts)
    for alias, target in renamed.items():
        mine[alias] = mine.pop(target)
    return mine


def _canonical(share: ShardedState, aliases: dict[str, str]) -> tuple[ShardedState, dict[str, str]]:
    renamed = {a: t for a, t in aliases.items() if a in share.expected and t not in share.expected}
    if not renamed:
        return share, {}
    out = ShardedState({renamed.get(n, n): e for n, e in share.expected.items()}, share.plan)
    out.update({renamed.get(n, n): pieces for n, pieces in share.items()})
    return out, renamed


def _reassemble(share: ShardedState, groups: list[list[int]], my_rank: int,
                parts: list[Callable[[str], bool]] | None) -> dict[str, dict[str, Any]]:
    mine: dict[str, dict[str, Any]] = {}
    member = False
    for i, ranks in enumerate(groups):
        group = dist.new_group(ranks)
        if my_rank not in ranks:
            continue
        member = True
        part = share if parts is None else _restricted(share, parts[i])
        shares: list[Any] = [None] * len(ranks)
        dist.all_gather_object(shares, part, group=group)
        mine.update(assemble(shares))
    if not member:
        raise RuntimeError(f"rank {my_rank} is in no group of live holders {groups}")
    return mine


def _restricted(share: ShardedState, keep: Callable[[str], bool]) -> ShardedState:
    out = ShardedState({n: e for n, e in share.expected.items() if keep(n)}, share.plan)
    out.update({n: pieces for n, pieces in share.items() if keep(n)})
    return out


def stage_holder_groups(pp: int, dp: int, tp: int, live_nodes: set[int], rank_of: Callable[[int, int], int]
                        ) -> list[list[int]]:
    """New-world ranks of the live nodes of each generation-0 stage (node of stage s, replica d: s*dp + d),
    per tensor-parallel rank, in one global order."""
    return [[rank_of(s * dp + d, t) for d in range(dp) if s * dp + d in live_nodes]
            for s in range(pp) for t in range(tp)]


def unit_holder_groups(plan: Any, live_nodes: set[int], tp: int, rank_of: Callable[[int, int], int], num_layers: int,
                       tied_names: Collection[str] = ()) -> tuple[list[list[int]], list[Callable[[str], bool]]]:
    """For state captured in ``plan``'s layout (``replica_optimizer``): one group per set of live nodes that
    held the same units, per tensor-parallel rank, in one global order, and which parameter names each
    group assembles. ``tied_names``: the tied embedding weight's names, whose shards were kept over the
    holders of either end (``replica_optimizer.TIED_UNIT``): one more group of those, last."""
    from ..planning.sharding import tied_holders
    from ..runtime.grad_sync import unit_of

    by_set: dict[tuple[int, ...], set[int]] = defaultdict(set)
    for unit, nodes in plan.holders().items():
        live = tuple(n for n in nodes if n in live_nodes)
        if live:
            by_set[live].add(unit)
    groups, parts = [], []
    for nodes in sorted(by_set):
        units = frozenset(by_set[nodes])
        for t in range(tp):
            groups.append([rank_of(n, t) for n in nodes])
            parts.append(lambda name, units=units: unit_of(name, num_layers) in units and name not in tied_names)
    ends = [n for n in tied_holders(plan.holders(), num_layers) if n in live_nodes] if tied_names else []
    for t in range(tp if ends else 0):
        groups.append([rank_of(n, t) for n in ends])
        parts.append(lambda name: name in tied_names)
    return groups, parts


def shards_lost(pp: int, dp: int, instances: int, dead_nodes: set[int]) -> list[int]:
    """Generation-0 stages some shard of which died with all ``instances`` holders (replicas j, j + d/N, ...)."""
    size = dp // instances
    return [s for s in range(pp)
            if any(all(s * dp + j + i * size in dead_nodes for i in range(instances)) for j in range(size))]


@contextlib.contextmanager
def deferred_param_sync(megatron_optimizer: Any) -> Iterator[list[Callable[[], Any]]]:
    """While Megatron's ``optimizer.step`` runs, keep the parameter all-gather it starts after the local
    shard update (``DistributedOptimizer.step_with_ready_grads`` -> ``model_chunk.start_param_sync``, or in
    0.19+ ``start_param_sync_for_bucket_group_subset``) for
    later: the caller marks the step committed first, so a failure inside the all-gather (a collective)
    never makes a survivor apply the same update twice. Yields the list of deferred calls."""
    deferred: list[Callable[[], Any]] = []
    owners: list[tuple[Any, str]] = []
    for opt in distributed_optimizers(megatron_optimizer):
        if hasattr(opt, "start_param_sync_for_bucket_group_subset"):  # 0.19+: the optimizer starts it itself
            owners.append((opt, "start_param_sync_for_bucket_group_subset"))
        else:
            owners += [(chunk, "start_param_sync") for chunk in opt.model_chunks]
    for owner, attr in owners:
        real = getattr(owner, attr)

        def later(*args: Any, _real: Callable[..., Any] = real, **kwargs: Any) -> None:
            deferred.append(lambda: _real(*args, **kwargs))

        setattr(owner, attr, later)
    try:
        yield deferred
    finally:
        for owner, attr in owners:
            owner.__dict__.pop(attr, None)
