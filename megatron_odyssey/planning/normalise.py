"""ReCycle's failure normalisation (Gandhi et al., SOSP '24; ``papers/recycle-slides.txt``, Algorithm 1)
and the grid it leads to, shared by the planner (a normalised reroute is one of Odyssey's candidates)
and the simulator's ReCycle baseline.

Normalisation decides how many of the F failed workers each of the PP stages should carry so that
rerouted work fits the pipeline bubbles best; it is realised by changing which stage surviving
workers serve (a worker that changes stage fetches that stage's parameters from a data-parallel
peer). Its per-stage cost counts the time slots of rerouted work (F = 1 slot, B = 2 slots) that do
not fit in the bubbles of the stage's surviving peers:

    COST(f) = max(0, MB*f*3 - (DP - f)*(PP - 1)*3)   for 0 < f < DP, COST(0) = 0.

The slides print ``min(0, ...)``, which is a typo: min(0, x) is never positive, so every
assignment would cost <= 0 and the DP could not tell a spread of failures from a pile-up. We use
``max`` and add what the slides leave implicit: a stage that loses every replica (f >= DP) cannot
be rerouted at all (infinite cost).
"""
from __future__ import annotations

import math

from .plan import ExecutionPlan, Pipeline, Stage


def normalisation_cost(f: int, mb: int, dp: int, pp: int) -> float:
    """Slides' COST(f) with the ``min`` typo fixed to ``max``; infinite once a stage has no replica left."""
    if f <= 0:
        return 0.0
    if f >= dp:
        return math.inf
    return float(max(0, mb * f * 3 - (dp - f) * (pp - 1) * 3))


def failure_normalisation(dp: int, pp: int, mb: int, failures: int) -> tuple[list[int], float]:
    """Algorithm 1 (FAILURE_NORMALIZATION): failures per stage minimising the summed COST.

    ``O[i][f]`` is the least cost of placing f failures on stages 0..i and ``A[i][f]`` the placement.
    Ties (common: COST is 0 while bubbles absorb the work) go to the placement with the fewest
    failures on its most loaded stage, then to the lexicographically smallest, so the result is
    deterministic and spreads failures (the slides' "distribute across different peers").
    Returns (placement, cost); cost is infinite when no placement keeps a replica of every stage.
    """
    if failures < 0 or pp < 1 or dp < 1:
        raise ValueError("need failures >= 0, pp >= 1, dp >= 1")
    O = [[math.inf] * (failures + 1) for _ in range(pp)]
    A: list[list[list[int]]] = [[[] for _ in range(failures + 1)] for _ in range(pp)]
    for f in range(failures + 1):
        O[0][f] = normalisation_cost(f, mb, dp, pp)
        A[0][f] = [f]
    for i in range(1, pp):
        for f in range(failures + 1):
            best_key, best = None, None
            for x in range(f + 1):
                o = O[i - 1][f - x] + normalisation_cost(x, mb, dp, pp)
                cand = A[i - 1][f - x] + [x]
                key = (o, max(cand), cand)
                if best_key is None or key < best_key:
                    best_key, best = key, (o, cand)
            assert best is not None
            O[i][f], A[i][f] = best
    return A[pp - 1][failures], O[pp - 1][failures]


def normalised_grid(plan: ExecutionPlan, failed: frozenset[int],
                    spread_only: bool = False) -> tuple[ExecutionPlan, dict[int, frozenset[int]]] | None:
    """The grid after normalising ``failed`` over the stages of a uniform grid (every pipeline the same
    split and batch): live workers of stages with too few failures swap places with dead positions
    of stages with too many. Returns the moved grid (dead nodes still named, in their new places)
    and, per moved live node, the units it must fetch; None when the grid is not uniform, when a stage
    has lost every replica, or when normalisation changes nothing (``spread_only``: when it would not
    lower the most failures any stage carries). By default a placement that only moves failures to
    other stages is offered too: stages differ (embedding, output layer), and the caller weighs the
    step time it gains against the transfer (Eq. 8, or ReCycle's step-time comparison)."""
    pipes = plan.pipelines
    if len({(p.layer_split(), p.micro_batches) for p in pipes}) != 1:
        return None
    pp, dp, mb = pipes[0].length, len(pipes), pipes[0].micro_batches
    nodes = [[p.stages[s].node for p in pipes] for s in range(pp)]  # nodes[stage][replica]
    counts = [sum(1 for n in nodes[s] if n in failed) for s in range(pp)]
    target, cost = failure_normalisation(dp, pp, mb, sum(counts))
    if max(counts) >= dp or not math.isfinite(cost) or target == counts:
        return None
    if spread_only and max(target) >= max(counts):  # a permutation of the same pile-up gains nothing
        return None
    takers = [s for s in range(pp) for _ in range(counts[s] - target[s]) if counts[s] > target[s]]
    givers = [s for s in range(pp) for _ in range(target[s] - counts[s]) if target[s] > counts[s]]
    targets: dict[int, frozenset[int]] = {}
    for recv, give in zip(takers, givers):
        d_dead = next(d for d, n in enumerate(nodes[recv]) if n in failed)
        d_live = max(d for d, n in enumerate(nodes[give]) if n not in failed)
        mover, dead = nodes[give][d_live], nodes[recv][d_dead]
        nodes[recv][d_dead], nodes[give][d_live] = mover, dead
        targets[mover] = plan.stage_units(d_dead, recv)
    moved = tuple(Pipeline(tuple(Stage(nodes[s][d], st.layer_start, st.layer_end) for s, st in enumerate(p.stages)),
                           p.micro_batches) for d, p in enumerate(pipes))
    return ExecutionPlan(plan.policy, plan.num_layers, moved), targets
