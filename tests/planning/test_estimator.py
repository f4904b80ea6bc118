"""Closed forms against hand computation, and the Eq. 11 simulation against them."""
import math
from dataclasses import replace

import pytest

from megatron_odyssey.planning.estimator import (eq9_step_time, eq12_step_time, eq13_step_time, eq14_peak_memory,
                                                 estimate_step, simulate)
from megatron_odyssey.planning.plan import layout, symmetric_plan
from megatron_odyssey.planning.planner import reroute_plan
from megatron_odyssey.planning.profile import LayerCost, uniform_profile


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
