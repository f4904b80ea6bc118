"""ReCycle's planner pieces (Gandhi et al., SOSP '24; ``papers/recycle-slides.txt``): failure
normalisation and the step time of its adaptive schedule.

Failure normalisation (slides' Algorithm 1) decides how many of the F failed workers each of the PP
stages should carry so that rerouted work fits the pipeline bubbles best; ReCycle realises the
assignment by changing which stage surviving workers serve (a worker that changes stage fetches that
stage's parameters from a data-parallel peer). Its per-stage cost counts the time slots of rerouted
work (F = 1 slot, B = 2 slots) that do not fit in the bubbles of the stage's surviving peers:

    COST(f) = max(0, MB*f*3 - (DP - f)*(PP - 1)*3)   for 0 < f < DP, COST(0) = 0.

The slides print ``min(0, ...)``, which is a typo: min(0, x) is never positive, so every
assignment would cost <= 0 and the DP could not tell a spread of failures from a pile-up. We use
``max`` and add what the slides leave implicit: a stage that loses every replica (f >= DP) cannot
be rerouted at all (infinite cost).

The adaptive schedule (decoupled back-propagation + staggered optimizer) hides rerouted micro-batches
in bubbles; what does not fit lengthens the step. We model the step's compute part as

    max(fault-free 1F1B compute, max over stages with failures of
        (MB + ceil(MB*f/(DP-f))) * (T_f + T_b) + r * (PP-1) * (T_f + T_b))

i.e. the busiest surviving peer's own plus adopted work, plus the share ``r`` of its bubble that the
schedule still cannot fill. ``r = 2/9`` comes from the slides' worked example (PP=4, DP=3, MB=6,
one failure: 27 time slots fault-free, 36 with naive rerouting, 29 with decoupled back-propagation:
2 of the stage's 9 bubble slots stay empty). Per-stage T_f, T_b and the fault-free compute come from
the planning estimator, as for every other policy.
"""
from __future__ import annotations

import math
from typing import Sequence


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


def adaptive_compute_time(stage_costs: Sequence[tuple[float, float]], failures: Sequence[int], dp: int, mb: int,
                          fault_free_compute_s: float, residual_bubble: float) -> float:
    """Compute part of one step under ReCycle's adaptive schedule (model in the module docstring)."""
    pp = len(stage_costs)
    worst = fault_free_compute_s
    for (t_f, t_b), f in zip(stage_costs, failures):
        if f <= 0:
            continue
        if f >= dp:
            return math.inf
        adopted = -(-mb * f // (dp - f))
        per_mb = t_f + t_b
        worst = max(worst, (mb + adopted) * per_mb + residual_bubble * (pp - 1) * per_mb)
    return worst
