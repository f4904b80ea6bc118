"""Where a unit's optimizer state lives when it is sharded over the unit's holders with replicas.

A job on Megatron's distributed optimizer keeps its optimizer state sharded after a failure too
(``megatron_lm.replica_optimizer``): each unit's state (fp32 main weights and Adam moments) is cut into one
contiguous shard per holder, in the order of the plan's holder list, and holder ``i`` keeps shards ``i, i+1,
..., i+copies-1`` (mod the number of holders), so every shard lives on ``copies`` consecutive holders, like
MindSpeed's replica optimizer. With ``copies`` = 2 any single failure leaves a live copy of every shard; the
state is lost only when all keepers of one shard die together. ``copies`` = 0 means no sharding: every holder
keeps its units' whole state (the plain optimizer). The memory model (Eq. 14) and the restart risk both read
this module, the runtime cuts its shards with :func:`shard_bounds` and :func:`kept_shards`.

With tied embeddings (the output layer's weight is the word embeddings') every holder of either end holds a
copy of one weight, and a stage holding both ends has a single weight for both: that weight's state is sharded
over every holder of either end (:func:`tied_holders`) instead of over its unit's holders, like a unit of its own.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence


def shard_bounds(numel: int, holders: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each holder's shard of a flattened tensor of ``numel`` elements: contiguous, in
    holder order, sizes differing by at most one (the first ``numel % holders`` shards are the longer)."""
    if holders < 1:
        raise ValueError(f"a shard needs at least one holder, got {holders}")
    base, extra = divmod(numel, holders)
    out, start = [], 0
    for i in range(holders):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def kept_shards(position: int, holders: int, copies: int) -> list[int]:
    """The shards the holder at ``position`` keeps: its own and the next ``copies - 1`` (all with copies 0)."""
    if copies <= 0 or holders <= copies:
        return list(range(holders))
    return [(position + j) % holders for j in range(copies)]


def optimizer_share(holders: int, copies: int) -> float:
    """Fraction of a unit's optimizer state each of its ``holders`` keeps."""
    if copies <= 0 or holders <= copies:
        return 1.0
    return copies / holders


def loss_sets(holders: Sequence[int], copies: int) -> list[tuple[int, ...]]:
    """Node sets whose joint death loses part of the unit's state: the keepers of each shard (the whole
    holder set when every holder keeps everything)."""
    h = len(holders)
    if copies <= 0 or h <= copies:
        return [tuple(holders)] if h else []
    return [tuple(holders[(j - c) % h] for c in range(copies)) for j in range(h)]


def tied_holders(holders: Mapping[int, Sequence[int]], num_layers: int) -> list[int]:
    """The nodes the tied embedding weight's state is sharded over: every holder of the embedding (unit 0) or
    the output layer (unit ``num_layers + 1``), in node order."""
    return sorted(set(holders.get(0, ())) | set(holders.get(num_layers + 1, ())))


def lost_units(holders: Mapping[int, Sequence[int]], dead: Iterable[int], copies: int,
               tied_layers: int | None = None) -> list[int]:
    """Units some part of whose state died with every node keeping it; ``tied_layers``: the model's layer count
    when its embeddings are tied, whose shared weight's loss loses both end units."""
    dead = set(dead)

    def gone(nodes: Sequence[int]) -> bool:
        return any(all(n in dead for n in keepers) for keepers in loss_sets(nodes, copies))

    lost = {u for u, nodes in holders.items() if gone(nodes)}
    if tied_layers is not None and copies > 0 and gone(tied_holders(holders, tied_layers)):
        lost |= {0, tied_layers + 1}
    return sorted(lost)
