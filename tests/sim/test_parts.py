"""Unit tests of the simulator's building blocks: events, ReCycle's planner pieces, cost model."""
from __future__ import annotations

import math

import pytest

from megatron_odyssey.planning.profile import uniform_profile
from megatron_odyssey.sim import SimulationConfig, SimulationError
from megatron_odyssey.sim.costmodel import CostModel
from megatron_odyssey.sim.events import interval_events, poisson_events, trace_events
from megatron_odyssey.sim.normalisation import adaptive_compute_time, failure_normalisation, normalisation_cost
from megatron_odyssey.sim.profiles import gpt3_medium_profile, resolve_model
from megatron_odyssey.sim.templates import TemplateModel
from megatron_odyssey.sim.traces import parse_trace_lines


def test_poisson_events_rate_and_determinism():
    a = poisson_events(1000, 1, 0.1, 3600.0, seed=7)
    assert a == poisson_events(1000, 1, 0.1, 3600.0, seed=7)
    n = sum(len(e.removed) for e in a.events)
    assert abs(n - 1000 * (1 - math.exp(-0.1))) < 4 * math.sqrt(95)  # ~95 failures in an hour
    b = poisson_events(125, 8, 0.1, 3600.0, seed=7)  # a node dies with the first of its 8 devices
    assert abs(sum(len(e.removed) for e in b.events) - 125 * (1 - math.exp(-0.8))) < 4 * math.sqrt(57)


def test_interval_events_never_remove_a_node_twice():
    s = interval_events(8, 600.0, 36000.0, seed=1)
    removed = [n for e in s.events for n in e.removed]
    assert len(removed) == len(set(removed)) == 8  # the cluster empties, then no more events


def test_trace_events_merge_simultaneous_lines():
    t = parse_trace_lines(["0,add,node1", "0,add,node2", "60000,remove,node1", "60000,add,node3",
                           "120000,add,node1"], "x")
    s = trace_events(t, 3600.0)
    assert s.initial == {0, 1}
    assert [(e.time_s, set(e.removed), set(e.added)) for e in s.events] == [(60.0, {0}, {2}), (120.0, set(), {0})]
    assert s.node_names[0] == "node1"


def test_shared_traces_parse():
    from pathlib import Path

    from megatron_odyssey.sim.traces import load_trace

    folder = Path("/work/shared/traces")
    if not folder.is_dir():
        pytest.skip("shared traces not available")
    for name, first in (("ec2-p3-spot.csv", 0.0), ("ec2-g4dn-spot.csv", 480.0)):
        t = load_trace(folder / name)
        assert t.events[0].time_s == first
        assert t.max_alive() in (32, 24)


def test_normalisation_cost_fixes_the_slides_min_typo():
    # the slides' worked example: PP=4, DP=3, MB=6, one failure -> 18 rerouted slots, 18 bubble slots
    assert normalisation_cost(1, mb=6, dp=3, pp=4) == 0
    assert normalisation_cost(2, mb=6, dp=3, pp=4) == 36 - 9  # 27 slots do not fit
    assert normalisation_cost(3, mb=6, dp=3, pp=4) == math.inf  # stage lost every replica
    # with the printed min(0, .) every placement would cost <= 0: the DP could not spread failures


def test_failure_normalisation_spreads_failures():
    placement, cost = failure_normalisation(dp=3, pp=4, mb=6, failures=4)
    assert sorted(placement) == [1, 1, 1, 1] and cost == 0
    placement, cost = failure_normalisation(dp=8, pp=4, mb=16, failures=6)
    assert sum(placement) == 6 and max(placement) - min(placement) <= 1
    _, cost = failure_normalisation(dp=2, pp=2, mb=4, failures=3)
    assert cost == math.inf  # some stage must lose both replicas


def test_adaptive_schedule_matches_slides_example():
    stages = [(1.0, 2.0)] * 4  # F = 1 slot, B = 2 slots
    ff = (4 + 6 - 1) * 3.0  # 27 slots
    assert adaptive_compute_time(stages, [0, 0, 0, 0], 3, 6, ff, 2 / 9) == ff
    assert adaptive_compute_time(stages, [0, 1, 0, 0], 3, 6, ff, 2 / 9) == pytest.approx(29.0)
    assert adaptive_compute_time(stages, [0, 1, 0, 0], 3, 6, ff, 0.0) == ff  # perfectly absorbed
    assert adaptive_compute_time(stages, [0, 3, 0, 0], 3, 6, ff, 2 / 9) == math.inf


def test_best_symmetric_is_near_the_exhaustive_best():
    prof = resolve_model("llama2-7b", 16, 1, 1)
    cost = CostModel(prof, 32, 1)
    for n in (6, 9, 13, 16):
        times = {}
        for pp in range(1, n + 1):
            for dp in range(1, n // pp + 1):
                plan = cost.symmetric(pp, dp, list(range(pp * dp)))
                if plan is not None and cost.estimate(plan).fits_memory:
                    times[(pp, dp)] = cost.step_time(plan)
        chosen = cost.best_symmetric_plan(list(range(n)))
        assert len(chosen.nodes()) <= n
        assert cost.step_time(chosen) <= min(times.values()) * 1.03


def test_template_model_is_eq9_for_identical_stages():
    prof = uniform_profile(12, forward_s=1.0, backward_s=2.0)
    tm = TemplateModel(prof)
    assert tm.template(4)[0] == (3, 3, 3, 3)
    assert tm.pipeline_time(4, 8) == pytest.approx((4 + 8 - 1) * 9.0)
    assert tm.min_nodes() == 1


def test_gpt3_medium_profile():
    p = gpt3_medium_profile()
    assert p.num_layers == 24
    params = sum(u.param_bytes for u in p.units()) / 2  # BF16 bytes -> parameters (embeddings counted twice)
    assert 350e6 < params < 460e6


def test_parse_policies():
    from megatron_odyssey.sim import DEFAULT_POLICIES, parse_policies

    assert parse_policies("odyssey, recycle") == ("odyssey", "recycle")
    assert parse_policies(None) == DEFAULT_POLICIES
    with pytest.raises(SimulationError, match="bamboo"):
        parse_policies("odyssey,bamboo")
    with pytest.raises(SimulationError, match="--policies lists odyssey more than once"):
        parse_policies("odyssey,recycle,odyssey")


def test_trace_that_removes_an_absent_node_says_where_and_why():
    from megatron_odyssey.sim import TraceFormatError

    with pytest.raises(TraceFormatError) as exc:
        parse_trace_lines(["0,add,node1", "0,add,node2", "60000,remove,node3"], "spot.csv")
    msg = str(exc.value)
    assert msg.startswith("spot.csv:3: at 60000 ms node3 is removed, but it was never added")
    assert "events at time 0" in msg and "expected 'time_ms" not in msg  # not a format problem
    assert exc.value.line_no == 3


def test_config_validation():
    with pytest.raises(SimulationError, match="--npus 32 must equal --tp x --pp x --dp"):
        SimulationConfig(npus=32, tp=1, pp=4, dp=4)
    with pytest.raises(SimulationError, match="--policies: unknown 'bamboo'"):
        SimulationConfig(policies=("odyssey", "bamboo"))
    with pytest.raises(SimulationError, match="--seeds must be a positive integer"):
        SimulationConfig(seeds=0)
    with pytest.raises(SimulationError, match="at most one"):
        SimulationConfig(failure_interval_h=1.0, trace="x.csv")
