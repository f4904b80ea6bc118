"""How to cut things up: survivors into pipelines, micro-batches over pipelines, layers over stages.

These are the three enumerations of Odyssey's Algorithm 1 (``integer_partition``,
``distribute_batch``, ``split_layers``) plus the exhaustive versions the oracle search uses.
"""
from __future__ import annotations

from functools import lru_cache
from itertools import combinations
from math import comb
from typing import Iterable, Iterator

from .errors import PlanningError
from .estimator import _plain_pipeline
from .profile import LayerCost, ModelProfile
from .sharding import optimizer_share

# -- pipelines ------------------------------------------------------------------------------------


def length_multisets(num_nodes: int, num_pipelines: int, min_len: int, max_len: int) -> Iterator[tuple[int, ...]]:
    """Every multiset of ``num_pipelines`` lengths in [min_len, max_len] summing to ``num_nodes``
    (non-increasing tuples)."""

    def rec(remaining: int, parts: int, cap: int) -> Iterator[tuple[int, ...]]:
        if parts == 0:
            if remaining == 0:
                yield ()
            return
        lo = max(min_len, remaining - cap * (parts - 1))
        hi = min(cap, remaining - min_len * (parts - 1))
        for first in range(hi, lo - 1, -1):
            for rest in rec(remaining - first, parts - 1, first):
                yield (first, *rest)

    if num_pipelines < 1 or min_len < 1:
        return
    yield from rec(num_nodes, num_pipelines, max_len)


def balanced_multisets(num_nodes: int, num_pipelines: int, min_len: int, max_len: int) -> list[tuple[int, ...]]:
    """Multisets whose lengths use at most two adjacent values (the balanced family), for clusters too
    large to enumerate every multiset."""
    out = []
    for low in range(min_len, max_len + 1):
        # a pipelines of length low+1, num_pipelines-a of length low
        a = num_nodes - low * num_pipelines
        if 0 <= a <= num_pipelines and (a == 0 or low + 1 <= max_len):
            out.append(tuple([low + 1] * a + [low] * (num_pipelines - a)))
    return out


# -- micro-batches --------------------------------------------------------------------------------


def distribute_batch(num_micro_batches: int, pipeline_sizes: list[int]) -> list[int]:
    """Odyssey's batch distribution: proportional to node count, the remainder one by one (largest
    fractional share first), then no pipeline left idle (take one from the largest partition)."""
    k = len(pipeline_sizes)
    if k == 0:
        raise PlanningError("no pipelines to distribute micro-batches over")
    if num_micro_batches < k:
        raise PlanningError(f"{num_micro_batches} micro-batches cannot keep {k} pipelines busy")
    total = sum(pipeline_sizes)
    alloc = [num_micro_batches * n // total for n in pipeline_sizes]
    order = sorted(range(k), key=lambda i: (-(num_micro_batches * pipeline_sizes[i] % total), -pipeline_sizes[i], i))
    for i in order[: num_micro_batches - sum(alloc)]:
        alloc[i] += 1
    while 0 in alloc:
        donor = max(range(k), key=lambda i: (alloc[i], -i))
        alloc[donor] -= 1
        alloc[alloc.index(0)] += 1
    return alloc


def compositions(total: int, parts: int, minimum: int = 1) -> Iterator[tuple[int, ...]]:
    """Every ordered way to write ``total`` as ``parts`` integers >= ``minimum``."""
    if parts == 1:
        if total >= minimum:
            yield (total,)
        return
    for first in range(minimum, total - minimum * (parts - 1) + 1):
        for rest in compositions(total - first, parts - 1, minimum):
            yield (first, *rest)


# -- layers ---------------------------------------------------------------------------------------


class PipelineModel:
    """Prefix sums over a profile so a layer split's stage costs and memory are O(stages).

    ``pipelines``: how many pipelines the plan has. Each holds every unit once, so every unit has that many
    holders, and with a sharded optimizer (``profile.optimizer_shard_copies``) a stage keeps only its share of
    each unit's optimizer state (``planning.sharding``), as the final plan check (``estimator.node_memory``)
    counts it: a layer split that fits only with shares is not thrown away early. With tied embeddings the end
    units' state is shared over the holders of either end: twice the pipelines, when a pipeline has two
    stages or more."""

    def __init__(self, profile: ModelProfile, pipelines: int = 1,
                 _family: dict[tuple[float, float], PipelineModel] | None = None):
        self.profile = profile
        key = self._shares(profile, pipelines)
        share, ends_share = key

        def static(u: LayerCost, share: float = share) -> int:  # as estimator.node_memory counts it
            return u.param_bytes + u.grad_bytes + round(u.optimizer_bytes * share)

        self.fwd = _prefix([u.forward_s for u in profile.layers])
        self.bwd = _prefix([u.backward_s for u in profile.layers])
        self.static = _prefix([static(u) for u in profile.layers])
        self.act = _prefix([u.activation_bytes for u in profile.layers])
        # (a one-stage pipeline holds both ends: the tied weight then has as many holders as there are pipelines)
        self.ends_static = {1: (static(profile.embedding), static(profile.output)),
                            2: (static(profile.embedding, ends_share), static(profile.output, ends_share))}
        self._family = {} if _family is None else _family  # shares -> model, shared by every pipeline count
        self._family.setdefault(key, self)

    @staticmethod
    def _shares(profile: ModelProfile, pipelines: int) -> tuple[float, float]:
        """A unit's share of its optimizer state, and an end unit's in pipelines of two stages or more."""
        copies = profile.optimizer_shard_copies
        share = optimizer_share(pipelines, copies)
        return share, (optimizer_share(2 * pipelines, copies) if profile.tied_embeddings else share)

    def with_pipelines(self, pipelines: int) -> PipelineModel:
        """This model in a plan of ``pipelines`` pipelines (the same object wherever the shares are the same, so
        the split caches keyed by it stay warm)."""
        return (self._family.get(self._shares(self.profile, pipelines))
                or PipelineModel(self.profile, pipelines, self._family))

    def stage_costs(self, split: tuple[int, ...]) -> tuple[tuple[float, float], ...]:
        prof, out, start = self.profile, [], 0
        for i, n in enumerate(split):
            f = self.fwd[start + n] - self.fwd[start]
            b = self.bwd[start + n] - self.bwd[start]
            if i == 0:
                f, b = f + prof.embedding.forward_s, b + prof.embedding.backward_s
            if i == len(split) - 1:
                f, b = f + prof.output.forward_s, b + prof.output.backward_s
            out.append((f, b))
            start += n
        return tuple(out)

    def peak_bytes(self, split: tuple[int, ...], micro_batches: int) -> int:
        """Eq. 14 of the fullest stage of a 1F1B pipeline: stage i holds min(p - i, m) micro-batches."""
        prof, p, start, peak = self.profile, len(split), 0, 0
        embedding_static, output_static = self.ends_static[min(p, 2)]
        for i, n in enumerate(split):
            static = self.static[start + n] - self.static[start]
            act = self.act[start + n] - self.act[start]
            if i == 0:
                static, act = static + embedding_static, act + prof.embedding.activation_bytes
            if i == p - 1:
                static, act = static + output_static, act + prof.output.activation_bytes
            peak = max(peak, static + min(p - i, micro_batches) * act)
            start += n
        return peak

    def fits(self, split: tuple[int, ...], micro_batches: int) -> bool:
        return self.peak_bytes(split, micro_batches) <= self.profile.device_memory_bytes

    def time(self, split: tuple[int, ...], micro_batches: int) -> float:
        return _plain_pipeline(self.stage_costs(split), micro_batches, self.profile.p2p_s)[0]

    def time_bound(self, split: tuple[int, ...], micro_batches: int) -> float:
        """A time no play of ``split`` beats, in O(stages): stage i cannot start before the first
        micro-batch's forward reaches it, then runs m forwards and m backwards one after another, and its last
        backward must still travel back to stage 0. The searches play only the splits whose bound leaves them a
        chance: a play costs O(stages x micro-batches), and hundreds of micro-batches per pipeline are common.
        (Lowered by 1e-9 of itself: the play adds the same durations in another order, so float rounding
        could put it a hair below the bound.)"""
        c, m = self.profile.p2p_s, micro_batches
        before, bound = 0.0, 0.0
        for i, (f, b) in enumerate(self.stage_costs(split)):
            bound = max(bound, before + 2 * i * c + m * (f + b))
            before += f + b
        return bound * (1 - 1e-9)


def _prefix(values: list[float]) -> list[float]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


MAX_REMAINDER_PLACEMENTS = 128
# A cheap play: a pipeline of at most CHEAP_PLAY_SLOTS stage x micro-batch slots (and, for the layer-split
# search, at most FULL_MOVES_MAX_STAGES stages) is played in well under a millisecond. Those get the wider
# searches: here a layer moved to any stage, not only a neighbour, and a front of splits one such move away;
# in the planner, pipeline counts outside the DP window and every batch split. On longer plays the play
# itself costs milliseconds and the wider searches seconds per decision.
FULL_MOVES_MAX_STAGES = 8
CHEAP_PLAY_SLOTS = 256
FRONT_SEEDS = 4  # ... from this many of the fastest base splits


def _small_play(stages: int, micro_batches: int) -> bool:
    return stages <= FULL_MOVES_MAX_STAGES and stages * micro_batches <= CHEAP_PLAY_SLOTS


def remainder_placements(num_layers: int, stages: int) -> list[tuple[int, ...]]:
    """Even split first, then every placement of the ``L mod p`` extra layers (one per stage);
    past ``MAX_REMAINDER_PLACEMENTS`` only placements that differ in the first/last stage and where
    the middle extras sit (front, back, spread), since middle stages cost the same."""
    base, extra = divmod(num_layers, stages)
    if base == 0:
        return []
    combos = list(combinations(range(stages), extra)) if comb(stages, extra) <= MAX_REMAINDER_PLACEMENTS \
        else _representative_placements(stages, extra)
    return [tuple(base + (1 if i in set(c) else 0) for i in range(stages)) for c in combos]


def _representative_placements(stages: int, extra: int) -> list[tuple[int, ...]]:
    out = set()
    middle = list(range(1, stages - 1))
    for first in (0, 1):
        for last in (0, 1):
            rest = extra - first - last
            if not 0 <= rest <= len(middle):
                continue
            ends = ([0] if first else []) + ([stages - 1] if last else [])
            spread = [middle[round(i * (len(middle) - 1) / max(rest - 1, 1))] for i in range(rest)] if rest else []
            for mid in (middle[:rest], middle[len(middle) - rest:], sorted(set(spread))):
                if len(mid) == rest:
                    out.add(tuple(sorted(ends + list(mid))))
    return sorted(out)


def max_units(split: tuple[int, ...]) -> int:
    """Most weight-holding units on one stage (embedding and output count): the colouring's lower
    bound on gradient-sync rounds, and what sets the slowest optimizer step."""
    return max(n + (i == 0) + (i == len(split) - 1) for i, n in enumerate(split))


def split_layers(model: PipelineModel, stages: int, micro_batches: int, improve: bool = True) -> tuple[int, ...] | None:
    """Odyssey's layer split: even first, enumerate the remainder's placements, drop those that do not
    fit in memory (Eq. 14), keep the fastest; then move single layers off the bottleneck stage while
    the estimate improves (covers embedding/output-heavy ends that an even split cannot balance)."""
    return _split_layers_cached(model, stages, micro_batches, improve)


@lru_cache(maxsize=65536)
def _split_layers_cached(model: PipelineModel, stages: int, micro_batches: int, improve: bool) -> tuple[int, ...] | None:
    def cost(split: tuple[int, ...]) -> float:
        return model.time(split, micro_batches)

    def bound(split: tuple[int, ...]) -> float:
        return model.time_bound(split, micro_batches)

    # the fastest placement, the first in placement order among equals; a placement whose bound exceeds the best
    # time so far cannot be it, so placements are played in bound order until the bound passes the best
    fitting = [s for s in remainder_placements(model.profile.num_layers, stages) if model.fits(s, micro_batches)]
    bounds = [bound(s) for s in fitting]
    best_key: tuple[float, int] = (float("inf"), -1)
    for n in sorted(range(len(fitting)), key=lambda n: bounds[n]):
        if bounds[n] > best_key[0]:
            break
        best_key = min(best_key, (cost(fitting[n]), n))
    if best_key[1] < 0:
        return None
    best_t, best = best_key[0], fitting[best_key[1]]
    if not improve:
        return best
    while True:
        moved = False
        for src in sorted(range(stages), key=lambda i: -sum(model.stage_costs(best)[i])):
            if best[src] <= 1:
                continue
            # to a neighbour; on short pipelines to any other stage, nearest first (the boundaries between them
            # all shift by one layer): neighbours alone miss splits like (2,3,2,2,1), where the output stage
            # sheds a layer to stage 1. On long pipelines the wider search costs seconds per decision.
            far = _small_play(stages, micro_batches)
            for dst in sorted((d for d in range(stages) if d != src and (far or abs(d - src) == 1)),
                              key=lambda d: (abs(d - src), d)):
                trial = list(best)
                trial[src] -= 1
                trial[dst] += 1
                trial_t = tuple(trial)
                if model.fits(trial_t, micro_batches) and bound(trial_t) < best_t - 1e-12:
                    t = cost(trial_t)
                    if t < best_t - 1e-12:
                        best, best_t, moved = trial_t, t, True
                        break
            if moved:
                break
        if not moved:
            return best


@lru_cache(maxsize=65536)
def split_front(model: PipelineModel, stages: int, micro_batches: int) -> tuple[tuple[int, ...], ...]:
    """The heuristic's splits (the remainder placements, the improved split, and each with one layer
    moved off an end stage) that are Pareto-optimal in (pipeline time, most units on one node): the
    second coordinate sets the whole plan's gradient-sync rounds, which one pipeline cannot see."""
    base = split_layers(model, stages, micro_batches)
    if base is None:
        return ()
    candidates = set(remainder_placements(model.profile.num_layers, stages)) | {base}
    if _small_play(stages, micro_batches):  # every split one single-layer move away from the fastest few
        fits = [s for s in candidates if model.fits(s, micro_batches)]
        seeds = sorted(fits, key=lambda s: (model.time(s, micro_batches), s))[:FRONT_SEEDS]
        candidates |= {moved for split in seeds for moved in _single_moves(split, range(stages))}
    else:
        for split in list(candidates):
            candidates |= set(_single_moves(split, (0, stages - 1), neighbours_only=True))
    return _front([s for s in candidates if model.fits(s, micro_batches)], model, micro_batches)


def _single_moves(split: tuple[int, ...], sources: Iterable[int], neighbours_only: bool = False) -> Iterator[tuple[int, ...]]:
    """Splits with one layer moved from a source stage to another stage (the boundaries between shift)."""
    for src in sources:
        if split[src] <= 1:
            continue
        for dst in range(len(split)):
            if dst != src and (not neighbours_only or abs(dst - src) == 1):
                moved = list(split)
                moved[src] -= 1
                moved[dst] += 1
                yield tuple(moved)


def _front(splits: list[tuple[int, ...]], model: PipelineModel, micro_batches: int) -> tuple[tuple[int, ...], ...]:
    best: dict[int, tuple[float, tuple[int, ...]]] = {}
    for split in splits:
        units = max_units(split)
        if units in best and model.time_bound(split, micro_batches) >= best[units][0]:
            continue  # (cannot be faster than the split kept for its units)
        t = model.time(split, micro_batches)
        if units not in best or t < best[units][0]:
            best[units] = (t, split)
    front, fastest = [], float("inf")
    for units in sorted(best):
        t, split = best[units]
        if t < fastest:
            front.append(split)
            fastest = t
    return tuple(front)
