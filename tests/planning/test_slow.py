"""The slow-node decision: per-node speeds in the Eq. 11 play, rebalancing, and Eq. 8's choice."""
from itertools import product

import pytest

from megatron_odyssey.planning.errors import PlanningError
from megatron_odyssey.planning.estimator import estimate_step, simulate
from megatron_odyssey.planning.plan import Pipeline, layout
from megatron_odyssey.planning.planner import Planner, PlannerOptions
from megatron_odyssey.planning.profile import uniform_profile
from megatron_odyssey.planning.slow import decide_slow, rebalanced


def _grid(dp=4, pp=2, layers=8, mbs=4):
    return layout([((layers // pp,) * pp, mbs)] * dp, num_layers=layers, policy="initial")


def _planner(prof, batch=16):
    return Planner(prof, batch, 1, PlannerOptions(mtbf_hours=1000))


def test_slowdown_scales_the_slow_nodes_operations_by_hand():
    prof = uniform_profile(8)  # forward 1, backward 2 per layer, no p2p time
    plan = _grid()
    base = simulate(plan, prof).pipeline_times
    assert simulate(plan, prof, slowdown={5: 1.0}).pipeline_times == base
    # 1F1B, 2 stages of 4 layers, 4 micro-batches: (m + p - 1)(f + b) = 5 * 12 = 60 without a slow node;
    # node 5 is stage 1 of pipeline 2; twice as slow it is the bottleneck: f0 + m (f1 + b1) + b0 = 4 + 4*24 + 8
    slowed = simulate(plan, prof, slowdown={5: 2.0}).pipeline_times
    assert base == [60.0] * 4
    assert slowed == [60.0, 60.0, 108.0, 60.0]
    assert estimate_step(plan, prof, slowdown={5: 2.0}).compute_s == 108.0


def test_slowdown_applies_to_adopted_work_on_the_node_that_runs_it():
    from megatron_odyssey.planning.planner import reroute_plan

    prof = uniform_profile(8)
    rerouted = reroute_plan(_grid(), frozenset({1}))
    peers = {r.peer for r in rerouted.reroutes}
    slow_peer = min(peers)
    assert max(simulate(rerouted, prof, slowdown={slow_peer: 3.0}).pipeline_times) > \
        max(simulate(rerouted, prof).pipeline_times)


def test_rebalance_is_optimal_against_every_micro_batch_split():
    prof = uniform_profile(8)
    plan = _grid()
    for factor in (1.5, 2.0, 3.0, 6.0):
        slow = {5: factor}
        got = rebalanced(plan, _planner(prof), slow)
        got_t = max(simulate(got, prof, slowdown=slow).pipeline_times)
        best = min(
            max(simulate(plan.__class__(plan.policy, 8, tuple(Pipeline(p.stages, m) for p, m in zip(plan.pipelines, c))),
                         prof, slowdown=slow).pipeline_times)
            for c in product(range(1, 14), repeat=4) if sum(c) == 16)
        assert got_t == pytest.approx(best), factor
        assert got.num_micro_batches == 16


def test_eq8_chooses_between_carrying_on_rebalancing_and_dropping():
    prof = uniform_profile(8)
    planner = _planner(prof)
    plan = _grid()
    assert decide_slow(planner, plan, {5: 1.0}).action == "none"
    assert decide_slow(planner, plan, {5: 1.1}).action == "none"  # moving a micro-batch costs more than 10%
    for factor in (1.1, 2.0, 3.0, 10.0):
        d = decide_slow(planner, plan, {5: factor})
        scores = {o.action: o.candidate.score for o in d.options if o.candidate.feasible}
        assert d.chosen.candidate.score == max(scores.values())
        assert {"none", "drop"} <= set(scores)
    assert decide_slow(planner, plan, {5: 10.0}).action in ("rebalance", "drop")
    d = decide_slow(planner, plan, {5: 3.0})
    by = {o.action: o.candidate for o in d.options}
    # [5, 5, 1, 5]: three pipelines of 5 micro-batches take (5 + 1) x 12 = 72; the slow one with 1 takes
    # 4 + 3 x 4 + 3 x 8 + 8 = 48. Dropping node 5 reroutes its 4 micro-batches to its 3 twins: also 72
    assert [p.micro_batches for p in by["rebalance"].plan.pipelines] == [5, 5, 1, 5]
    assert by["rebalance"].step_time_s == 72.0 and by["drop"].step_time_s == 72.0
    # equal steps: the rebalance redoes a step and rebuilds (10 s + 156 s), the reroute costs 1 s
    assert by["rebalance"].transition.total_s == 166.0
    assert d.action == "drop"


def test_rebalance_scores_best_when_dropping_is_impossible():
    prof = uniform_profile(8)
    planner = _planner(prof)
    plan = _grid(dp=2, pp=2, mbs=8)  # dropping node 3 leaves stage 1 one replica: reroute doubles node 1's work
    d = decide_slow(planner, plan, {3: 2.0})
    by = {o.action: o.candidate for o in d.options}
    assert by["rebalance"].step_time_s < by["none"].step_time_s
    assert d.action in ("rebalance", "drop")


def test_dropping_the_last_copy_of_a_stage_is_never_chosen():
    """A rerouted plan whose stage 0 is left on node 0 alone (node 2 dead): dropping node 0, however slow, would
    lose every copy of stage 0's layers, i.e. restart the job from its last checkpoint (or from scratch). The
    diagnosis carries on or rebalances instead, and says why."""
    from megatron_odyssey.planning.planner import reroute_plan

    prof = uniform_profile(8)
    planner = _planner(prof)
    plan = reroute_plan(_grid(dp=2, pp=2, mbs=8), frozenset({2}))  # pipelines (0, 1) and (2, 3)
    for factor in (2.0, 10.0, 100.0):
        d = decide_slow(planner, plan, {0: factor})
        assert d.action in ("none", "rebalance"), d.to_json()
        (drop,) = [o.candidate for o in d.options if o.action == "drop"]
        assert not drop.feasible and "a diagnosis never restarts the job" in drop.reason


def test_a_recovered_node_is_readmitted_by_rebalancing_back():
    prof = uniform_profile(8)
    planner = _planner(prof)
    plan = _grid()
    skewed = decide_slow(planner, plan, {5: 3.0}).options[1].candidate.plan
    assert [p.micro_batches for p in skewed.pipelines] != [4, 4, 4, 4]
    back = decide_slow(planner, skewed, {})
    assert back.action == "rebalance"
    assert [p.micro_batches for p in back.plan.pipelines] == [4, 4, 4, 4]


def test_bad_slowdowns_are_refused():
    prof = uniform_profile(8)
    with pytest.raises(PlanningError, match="live in the current plan"):
        decide_slow(_planner(prof), _grid(), {99: 2.0})
    with pytest.raises(PlanningError, match="factors >= 1"):
        decide_slow(_planner(prof), _grid(), {1: 0.5})
