"""Closed forms against hand computation, and the Eq. 11 simulation against them."""
import math
import random
from dataclasses import replace

import pytest

from megatron_odyssey.planning.estimator import (_plain_pipeline, eq9_step_time, eq12_step_time, eq13_step_time,
                                                 eq14_peak_memory, estimate_step, simulate)
from megatron_odyssey.planning.plan import ExecutionPlan, layout, symmetric_plan
from megatron_odyssey.planning.planner import reroute_plan
from megatron_odyssey.planning.profile import LayerCost, uniform_profile
from megatron_odyssey.planning.schedule import fault_free_slots, one_f_one_b


def test_eq9_hand_computed():
    # 4 stages, 8 micro-batches, Tf=1, Tb=2: (4 + 8 - 1) * 3 = 33
    assert eq9_step_time(4, 8, 1.0, 2.0) == 33.0


def test_eq12_hand_computed():
    # PP=2, Nm=4, DP=3, Tf=4, Tb=8: (2 + 4 - 1 + 4/2) * 12 = 84
    assert eq12_step_time(2, 4, 3, 4.0, 8.0) == 84.0
    assert eq12_step_time(2, 4, 1, 4.0, 8.0) == math.inf


def test_eq13_hand_computed():
    # PP=4, Nm=8, DP=4, F=[1,0,2,0]: extra = 8*1/3 + 8*2/2 = 10.667; (4+8-1+10.667)*3 = 65
    assert eq13_step_time(4, 8, 4, [1, 0, 2, 0], 1.0, 2.0) == pytest.approx(65.0)
    # one failure reduces to Eq. 12
    assert eq13_step_time(2, 4, 3, [1, 0], 4.0, 8.0) == eq12_step_time(2, 4, 3, 4.0, 8.0)
    # a stage that lost every replica cannot be rerouted
    assert eq13_step_time(2, 4, 3, [3, 0], 4.0, 8.0) == math.inf


def test_eq14_hand_computed():
    # stage 1 of 4, 2 layers, mp=1, mo=2, mg=1, ma=3: 2*(4) + (4-1)*2*3 = 26
    assert eq14_peak_memory(1, 4, 2, 1, 2, 1, 3) == 26


@pytest.mark.parametrize("pp,dp,layers,m", [(1, 1, 4, 3), (2, 2, 8, 4), (4, 1, 8, 8), (4, 2, 8, 3), (4, 1, 8, 2),
                                            (3, 2, 9, 7), (8, 1, 8, 16), (2, 3, 6, 1)])
def test_simulation_equals_eq9_on_symmetric_uniform(pp, dp, layers, m):
    prof = uniform_profile(layers, forward_s=0.5, backward_s=1.25)
    plan = symmetric_plan(pp, dp, layers, m * dp)
    per_stage = layers // pp
    expected = eq9_step_time(pp, m, 0.5 * per_stage, 1.25 * per_stage)
    assert simulate(plan, prof).pipeline_times == [expected] * dp
    assert estimate_step(plan, prof).step_time_s == expected  # free sync, no optimizer cost


def _layers(costs):
    return tuple(LayerCost(f"layer{i}", f, b, 0, 0, 0, 0) for i, (f, b) in enumerate(costs))


def test_simulation_on_hand_drawn_asymmetric_case():
    """Fig. 5b-like: pipeline A = 2 uneven stages (F 1/2, B 2/4) with 3 micro-batches, pipeline B = one
    stage with all 3 layers (F 3, B 6) and 1 micro-batch. Timeline of A drawn by hand:
    s0 F0 0-1 | s1 F0 1-3, B0 3-7 | s0 F1 1-2, B0 7-9 | s1 F1 7-9, B1 9-13 | s0 F2 9-10, B1 13-15 |
    s1 F2 13-15, B2 15-19 | s0 B2 19-21  => 21. B: 3 + 6 = 9. Step = max = 21 (Eq. 10)."""
    prof = replace(uniform_profile(3), layers=_layers([(1, 2), (1, 2), (1, 2)]))
    plan = layout([((1, 2), 3), ((3,), 1)])
    assert simulate(plan, prof).pipeline_times == [21.0, 9.0]
    assert estimate_step(plan, prof).step_time_s == 21.0


def test_simulation_adds_p2p_per_stage_boundary():
    prof = uniform_profile(2, forward_s=1.0, backward_s=1.0, p2p_s=0.5)
    plan = layout([((1, 1), 1)])
    # F s0 0-1, send 0.5, F s1 1.5-2.5, B s1 2.5-3.5, send 0.5, B s0 4-5
    assert simulate(plan, prof).pipeline_times == [5.0]


def test_rerouted_simulation_between_fault_free_and_eq12():
    prof = uniform_profile(8)
    plan = symmetric_plan(2, 3, 8, 12)
    rerouted = reroute_plan(plan, frozenset({1}))
    times = simulate(rerouted, prof).pipeline_times
    fault_free = eq9_step_time(2, 4, 4.0, 8.0)
    assert fault_free < max(times) <= eq12_step_time(2, 4, 3, 4.0, 8.0)
    # the dead node's pipeline waits on borrowed stage time, so it is slower than fault-free too
    assert times[1] > fault_free


def test_peak_memory_follows_eq14_on_symmetric():
    prof = uniform_profile(8, layer_bytes=10, activation_bytes=3)
    plan = symmetric_plan(4, 1, 8, 8)
    est = estimate_step(plan, prof)
    for stage in range(4):
        # layer_bytes=10 -> param 10, grad 10, optimizer 20
        assert est.peak_memory_bytes[stage] == eq14_peak_memory(stage, 4, 2, 10, 20, 10, 3)


def test_adopting_micro_batches_raises_a_peers_memory():
    prof = uniform_profile(8, layer_bytes=10, activation_bytes=3)
    plan = symmetric_plan(2, 2, 8, 8)
    base = estimate_step(plan, prof).peak_memory_bytes[2]
    rerouted = estimate_step(reroute_plan(plan, frozenset({3})), prof).peak_memory_bytes[2]
    assert rerouted > base


# -- bubble filling (ReCycle's decoupled back-propagation) ------------------------------------------

def _slides_example(stage: int):
    """ReCycle slides, Design 2: 3 data-parallel pipelines of 4 stages, 6 micro-batches each, F = 1 slot,
    backward = 2 slots (input gradient 1, weight gradient 1); worker W_{1,stage} fails."""
    from megatron_odyssey.planning.schedule import deferred

    prof = uniform_profile(8, 0.5, 1.0)  # two layers per stage: F = 1, B = 2 per stage
    base = symmetric_plan(4, 3, 8, 18)
    plain = reroute_plan(base, frozenset({base.pipelines[1].stages[stage].node}))
    filled = replace(plain, fill=True)
    assert deferred(filled) and not deferred(plain)
    return prof, base, plain, filled


def test_overlapped_gradient_reduction_where_the_last_gradient_operation_is_a_whole_backward():
    """--overlap-grad-reduce starts a node's all-reduces inside its last backward. In a filled reroute every
    stage but the first defers its W's, so those nodes end the step on a W and reduce after it."""
    from megatron_odyssey.planning.schedule import overlapped_nodes

    _, base, plain, filled = _slides_example(stage=1)
    assert overlapped_nodes(base) == frozenset(base.live_nodes())
    assert overlapped_nodes(plain) == frozenset(plain.live_nodes())
    assert overlapped_nodes(filled) == frozenset(p.stages[0].node for p in filled.pipelines)


def test_slides_worked_example_27_36_29():
    """27 slots fault-free, 36 with the failed worker's 6 micro-batches spread over its 2 peers (the
    slides' "9 extra time steps"; Eq. 12 gives exactly that), 29 with decoupled back-propagation.
    The played 1F1B reroute (33) lies between: adopted operations take their fault-free slots."""
    prof, base, plain, filled = _slides_example(stage=1)  # W_{1,2}, stages counted from 1
    assert max(simulate(base, prof).pipeline_times) == 27 == eq9_step_time(4, 6, 1, 2)
    assert eq12_step_time(4, 6, 3, 1, 2) == 36
    assert max(simulate(plain, prof).pipeline_times) == 33
    assert max(simulate(filled, prof).pipeline_times) == 29


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_filling_never_slower_than_plain_reroute_on_the_slides_grid(stage):
    prof, base, plain, filled = _slides_example(stage)
    t_plain, t_fill = max(simulate(plain, prof).pipeline_times), max(simulate(filled, prof).pipeline_times)
    # the last stage's peers have 9 micro-batches x 3 slots of work after a 3-slot warm-up: 30 is the floor
    assert 27 < t_fill <= t_plain and t_fill == {0: 28, 1: 29, 2: 29, 3: 30}[stage]


def test_filled_orders_are_one_dependency_respecting_order():
    """The runtime runs these orders with blocking receives: every operation must start after what it
    consumes ends, and each node's operations must appear in start order, once each."""
    from megatron_odyssey.planning.schedule import WEIGHT_GRAD, dependency, filled_schedule

    for stage in range(4):
        _, _, plain, filled = _slides_example(stage)
        orders, start = filled_schedule(filled)
        seen = set()
        for node, ops in orders.items():
            assert [start[o] for o in ops] == sorted(start[o] for o in ops)
            seen.update(ops)
            for op in ops:
                dep = dependency(op, 4)
                assert dep is None or start[dep] < start[op]
        ws = {(o.pipeline, o.stage, o.micro_batch) for o in seen if o.kind == WEIGHT_GRAD}
        # every backward of a non-first stage of a coupled pipeline has its W; the rest have none
        assert ws and all(i > 0 for (_, i, _) in ws)
        assert len(seen) == sum(2 * p.micro_batches * p.length for p in plain.pipelines) + len(ws)


def test_deferred_weight_gradients_hold_activations_longer():
    """Eq. 14 with the real order: a micro-batch's activations stay until its W, so a peer that defers
    holds more at once, and a device too small for that is not offered the filled reroute."""
    prof, _, plain, filled = _slides_example(stage=1)
    prof = replace(prof, layers=tuple(replace(l, activation_bytes=10) for l in prof.layers))
    peer = next(r.peer for r in filled.reroutes)
    assert simulate(filled, prof).peak_in_flight[peer] > simulate(plain, prof).peak_in_flight[peer]
    from megatron_odyssey.planning.planner import Planner, PlannerOptions

    need_plain = max(estimate_step(plain, prof).peak_memory_bytes.values())
    tight = replace(prof, device_memory_bytes=need_plain)
    d = Planner(tight, 18, 1, PlannerOptions()).decide(symmetric_plan(4, 3, 8, 18), {filled.pipelines[1].stages[1].node})
    fill = next(c for c in d.candidates if c.policy == "reroute" and not c.feasible)
    assert "deferred weight gradients" in fill.reason


def test_staggered_plan_is_played_with_the_staggered_optimizer_and_holds_a_copy_of_its_state():
    """A plan that staggers (the runtime updates each rank before the commit) gets the staggered play without
    asking, and Eq. 14 counts the copy of weights and optimizer state kept until the commit; not filled: refused."""
    from megatron_odyssey.planning.errors import PlanningError

    prof, _, plain, filled = _slides_example(stage=1)
    staggered = replace(filled, stagger=True)
    assert simulate(staggered, prof).pipeline_times == simulate(filled, prof, staggered=True).pipeline_times
    # the worked example's 29 slots: the adopting peers of the second stage end with a W after their last B;
    # staggered, it overlaps the next step's warm-up, in which they wait one forward slot (the first stage's)
    assert max(simulate(filled, prof).pipeline_times) == 29 and max(simulate(staggered, prof).pipeline_times) == 28
    units = prof.units()
    copy = {n: sum(units[u].state_bytes for u in held) for n, held in staggered.holdings().items()}
    with_copy, without = estimate_step(staggered, prof).peak_memory_bytes, estimate_step(filled, prof).peak_memory_bytes
    assert all(with_copy[n] - without[n] == copy[n] > 0 for n in copy)
    assert ExecutionPlan.from_dict(staggered.to_dict()) == staggered and "stagger" not in filled.to_dict()
    with pytest.raises(PlanningError, match="stagger .* filled plans only"):
        replace(plain, stagger=True).validate()


def test_weight_gradient_share_comes_from_the_profile():
    """Nothing deferrable (a measured W of 0 s): the filled plan is the 1F1B reroute, same time."""
    prof, _, plain, filled = _slides_example(stage=1)
    none_w = replace(prof, layers=tuple(replace(l, weight_grad_s=0.0) for l in prof.layers))
    assert max(simulate(filled, none_w).pipeline_times) == max(simulate(plain, none_w).pipeline_times) == 33
    assert max(simulate(filled, prof).pipeline_times) == 29


def test_profile_rejects_a_weight_gradient_longer_than_backward():
    from megatron_odyssey.planning.errors import PlanningError
    from megatron_odyssey.planning.profile import ModelProfile

    data = uniform_profile(2).to_dict()
    data["layers"][0]["weight_grad_s"] = 5.0
    with pytest.raises(PlanningError, match="weight_grad_s.*between 0 and backward_s"):
        ModelProfile.from_dict(data, source="p.json")


def _slot_ordered_play(costs: tuple[tuple[float, float], ...], m: int, p2p: float) -> float:
    """The plain pipeline's play as first written: every operation in fault-free slot order, ends in a dict."""
    p = len(costs)
    slots = fault_free_slots(p, m)
    ops = sorted((slots[(kind, i, j)], kind, i, j) for i in range(p) for kind, j in one_f_one_b(p, i, m))
    end: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    for _, kind, i, j in ops:
        if kind == "F":
            ready, dur = (end[("F", i - 1, j)] + p2p if i > 0 else 0.0), costs[i][0]
        else:
            ready, dur = (end[("B", i + 1, j)] + p2p if i < p - 1 else end[("F", i, j)]), costs[i][1]
        free[i] = end[(kind, i, j)] = max(free[i], ready) + dur
    return max(free)


@pytest.mark.parametrize("seed", range(4))
def test_the_plain_pipelines_play_equals_the_slot_ordered_play_to_the_bit(seed):
    """The play visits operations in any order that respects each stage's sequence and each input (cheaper to
    build than the fault-free slot order at hundreds of micro-batches); the times must not move by one bit, or
    the searches would break ties differently."""
    rng = random.Random(seed)
    for _ in range(25):
        p, m = rng.randint(1, 9), rng.choice([1, 2, 3, 5, 8, 13, 64, 257])
        costs = tuple((rng.choice([0.25, 1 / 3, rng.random()]) + 0.01, rng.choice([0.5, 2 / 3, 2 * rng.random()]) + 0.01)
                      for _ in range(p))
        p2p = rng.choice([0.0, 1e-4, 0.37])
        time_s, peak = _plain_pipeline.__wrapped__(costs, m, p2p)
        assert time_s == _slot_ordered_play(costs, m, p2p), (costs, m, p2p)
        assert peak == tuple(min(p - i, m) for i in range(p))  # 1F1B: stage i holds its warm-up + 1


def test_the_plain_pipeline_is_eq9_at_hundreds_of_micro_batches():
    time_s, _ = _plain_pipeline.__wrapped__(((1.0, 2.0),) * 8, 512, 0.0)
    assert time_s == eq9_step_time(8, 512, 1.0, 2.0)
