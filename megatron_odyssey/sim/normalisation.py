"""ReCycle's adaptive-schedule closed form (Gandhi et al., SOSP '24; ``papers/recycle-slides.txt``), the
simulator's ``recycle_model="closed-form"``. Failure normalisation (Algorithm 1, with the slides'
``min`` typo fixed) lives in ``planning.normalise`` and is re-exported here.

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

from ..planning.normalise import failure_normalisation, normalisation_cost

__all__ = ["adaptive_compute_time", "failure_normalisation", "normalisation_cost"]


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
