"""The heuristic-versus-exhaustive sweep's configurations and its oracle (shared by the test and the script
that regenerates the stored optima)."""
from __future__ import annotations

from megatron_odyssey.planning.estimator import estimate_step
from megatron_odyssey.planning.planner import Planner, PlannerOptions
from megatron_odyssey.planning.profile import builtin_profile

SEQ = 4096
MICRO_BATCHES_PER_PIPELINE = (1, 2)  # the regime where fewer, longer pipelines win (sync dominates)


def sweep() -> list[tuple[int, int, int, int, int]]:
    """Every (pp, dp, layers, failures, global micro-batches) with 8-16 nodes, PP 2-4, 8-16 layers, 1-2
    failures, and 1 or 2 micro-batches per pipeline of the original grid."""
    return [(pp, dp, layers, failures, per * dp)
            for pp in (2, 3, 4) for dp in range(1, 17) if 8 <= pp * dp <= 16
            for layers in range(8, 17) for failures in (1, 2) for per in MICRO_BATCHES_PER_PIPELINE]


def shape(plan) -> list:
    return [[list(p.layer_split()), p.micro_batches] for p in plan.pipelines]


#: the sweep compares searches under one rule: at least two pipelines where they fit (Eq. 8's restart
#: risk, the product's default, decides between the floor's layouts and faster single pipelines later)
FLOOR = PlannerOptions(price_restart_risk=False)


def heuristic_best(pp: int, dp: int, layers: int, failures: int, m: int, options: PlannerOptions | None = None):
    prof = builtin_profile(num_layers=layers, seq_length=SEQ)
    plan = Planner(prof, m, 1, options or FLOOR).search_layout(pp * dp - failures, dp, pp)
    return estimate_step(plan, prof).step_time_s, shape(plan)


def exhaustive_best(pp: int, dp: int, layers: int, failures: int, m: int) -> tuple[float, list]:
    prof = builtin_profile(num_layers=layers, seq_length=SEQ)
    options = PlannerOptions(search="exhaustive", search_budget_s=None, price_restart_risk=False)
    plan = Planner(prof, m, 1, options).search_layout(pp * dp - failures, dp, pp)
    return estimate_step(plan, prof).step_time_s, shape(plan)
