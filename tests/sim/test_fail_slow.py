"""Fail-slow in the simulator: the event process, and how each policy variant reacts to a slow node."""
from __future__ import annotations

import pytest
from sim_helpers import small_config

from megatron_odyssey.planning.estimator import estimate_step
from megatron_odyssey.planning.profile import uniform_profile
from megatron_odyssey.planning.slow import decide_slow
from megatron_odyssey.sim import SimulationConfig, SimulationError, run_simulation
from megatron_odyssey.sim.engine import simulate_policy
from megatron_odyssey.sim.events import ClusterEvent, EventStream, add_fail_slow, poisson_events, slow_episodes
from megatron_odyssey.sim.failslow import FAIL_SLOW_PRESETS, SlowClass
from megatron_odyssey.sim.policies import make_policy
from megatron_odyssey.sim.policies.base import SimContext

HOUR = 3600.0


def _uniform_ctx(dp: int = 4, pp: int = 2) -> SimContext:
    """A PP x DP job on identical layers (forward 1 s, backward 2 s per layer, free communication and
    embedding, 10 s rebuild): step times can be worked out by hand."""
    cfg = small_config(npus=pp * dp, pp=pp, dp=dp, failure_rate=0.0, hours=10.0, seeds=1)
    return SimContext.build(cfg, uniform_profile(8), mtbf_hours=1000.0)


def _run(name: str, ctx: SimContext, events: tuple[ClusterEvent, ...], horizon_s: float = 10 * HOUR):
    policy = make_policy(name, ctx)
    stream = EventStream(frozenset(range(ctx.job_nodes)), events, horizon_s)
    return policy, simulate_policy(policy, stream, ctx)


# -- the event process ---------------------------------------------------------------------------------

def test_fail_slow_stream_is_deterministic_per_seed_and_leaves_failures_alone():
    base = poisson_events(32, 1, 0.1, 9 * HOUR, seed=3)
    classes = FAIL_SLOW_PRESETS["greyhound-x10"]
    a = add_fail_slow(base, classes, 1, seed=3)
    assert a == add_fail_slow(base, classes, 1, seed=3)
    assert a != add_fail_slow(base, classes, 1, seed=4)
    assert [e for e in a.events if e.removed or e.added] == [e for e in base.events]  # same failures, same order
    assert any(e.slowdown for e in a.events)
    dead: set[int] = set()
    for e in a.events:  # a dead node never gets slow or recovers
        dead |= e.removed
        assert not {n for n, _ in e.slowdown} & dead


def test_fail_slow_onsets_match_the_configured_rate_over_a_long_horizon():
    rate, mean_h, horizon_h = 0.01, 0.5, 2000.0
    c = SlowClass("test", rate, mean_h, (2.0, 3.0))
    for tp in (1, 2):
        onsets, slow_h = 0, 0.0
        for node in range(200):
            eps = slow_episodes(node, (c,), tp, horizon_h * HOUR, seed=0)
            onsets += len(eps)
            slow_h += sum(min(end, horizon_h * HOUR) - start for start, end, _, _ in eps) / HOUR
            assert {f for _, _, f, _ in eps} <= {2.0, 3.0}
        exposure = 200 * horizon_h - slow_h  # node-hours at full speed, when an onset can happen
        assert onsets / exposure == pytest.approx(tp * rate, rel=0.06)  # ~4000 (tp 1), ~8000 (tp 2) onsets
        assert slow_h / onsets == pytest.approx(mean_h, rel=0.06)


def test_a_node_that_stays_slow_never_recovers():
    c = SlowClass("forever", 0.05, None, (4.0,))
    s = add_fail_slow(EventStream(frozenset(range(16)), (), 100 * HOUR), (c,), 1, seed=1)
    changes = [x for e in s.events for x in e.slowdown]
    assert changes and all(f == 4.0 for _, f in changes)
    assert len({n for n, _ in changes}) == len(changes)  # each node slows once and stays slow


@pytest.mark.parametrize("kwargs, field", [
    (dict(rate_per_device_hour=-0.1), "rate_per_device_hour"),
    (dict(rate_per_device_hour=float("nan")), "rate_per_device_hour"),
    (dict(factors=(0.5,)), "factors"),
    (dict(factors=(2.0, 0.9)), "factors"),
    (dict(factors=()), "factors"),
    (dict(mean_duration_h=0.0), "mean_duration_h"),
    (dict(mean_duration_h=-1.0), "mean_duration_h"),
])
def test_bad_fail_slow_parameters_are_refused_by_name(kwargs, field):
    args = dict(name="bad", rate_per_device_hour=0.01, mean_duration_h=0.5, factors=(2.0,)) | kwargs
    with pytest.raises(SimulationError, match=f"'bad': {field}"):
        SlowClass(**args)


def test_unknown_fail_slow_preset_names_the_choices():
    with pytest.raises(SimulationError, match="--fail-slow bogus: unknown; choose from none, greyhound"):
        SimulationConfig(fail_slow="bogus")
    with pytest.raises(SimulationError, match="SlowClass"):
        SimulationConfig(fail_slow=("greyhound",))


# -- the three ways of handling a slow node ---------------------------------------------------------

def test_ignoring_a_slow_node_gives_the_estimators_slowed_throughput():
    ctx = _uniform_ctx()
    plan = ctx.initial_plan(list(range(8)))
    expected = ctx.cost.samples_per_step / estimate_step(plan, ctx.profile, slowdown={5: 2.0}).step_time_s
    events = (ClusterEvent(1 * HOUR, slowdown=((5, 2.0),)), ClusterEvent(2 * HOUR, slowdown=((5, 1.0),)))
    for name in ("odyssey-ignore-slow", "recycle", "oobleck", "checkpoint"):
        policy, run = _run(name, ctx, events)
        assert [r.kind for r in run.reactions] == ["start"], name  # nothing noticed
        full = ctx.cost.throughput(plan)
        assert run.throughput_at(0.5 * HOUR) == pytest.approx(full), name
        assert run.throughput_at(1.5 * HOUR) == pytest.approx(expected), name
        assert run.throughput_at(2.5 * HOUR) == pytest.approx(full), name
    assert expected == pytest.approx(16 / (4 + 4 * 24 + 8))  # 1F1B with node 5 (stage 1) twice as slow: 108 s


def test_slow_as_failure_drops_the_node_and_readmits_it_when_it_recovers():
    ctx = _uniform_ctx()
    events = (ClusterEvent(1 * HOUR, slowdown=((5, 1.1),)), ClusterEvent(2 * HOUR, slowdown=((5, 1.0),)))
    policy, run = _run("odyssey-slow-as-failure", ctx, events)
    used = {round(s.start_s / HOUR, 3): s.devices_used for s in run.segments}
    assert used[0.0] == 8 and min(s.devices_used for s in run.segments if 1 * HOUR <= s.start_s < 2 * HOUR) == 7
    assert run.segments[-1].devices_used == 8  # back after it recovered
    notes = [r.note for r in run.reactions]
    assert any(n.startswith("drop slow node(s) [5]") for n in notes)
    assert 5 in policy.nodes_in_use() and not policy.benched
    # even a 10% slowdown is dropped: the rule does not weigh it (Eq. 8 carries on, see below)
    _, eq8 = _run("odyssey", ctx, events)
    assert [r.kind for r in eq8.reactions] == ["start"]


def test_odyssey_reacts_as_decide_slow_chooses_when_a_node_slows_by_three():
    ctx = _uniform_ctx()
    plan = ctx.initial_plan(list(range(8)))
    expected = decide_slow(ctx.planner, plan, {5: 3.0})
    by = {o.action: o.candidate for o in expected.options}
    # by hand (tests/planning/test_slow.py): carrying on takes 4 + 4 x 36 + 8 = 156 s a step; rebalancing to
    # [5, 5, 1, 5] micro-batches and dropping node 5 (its 4 micro-batches on its 3 twins) both take 72 s;
    # the rebalance costs a rebuild and a redone step (10 + 156 s), the reroute 1 s: drop
    assert by["none"].step_time_s == 156.0 and by["rebalance"].step_time_s == 72.0
    assert expected.action == "drop"
    policy, run = _run("odyssey", ctx, (ClusterEvent(1 * HOUR, slowdown=((5, 3.0),)),))
    reaction = run.reactions[-1]
    assert reaction.note.startswith("drop slow node(s) [5]") and reaction.kind == expected.chosen.candidate.policy
    assert policy.plan == expected.plan and 5 not in policy.nodes_in_use() and policy.benched == {5}
    assert run.segments[-1].throughput == pytest.approx(ctx.cost.throughput(expected.plan))


def test_odyssey_rebalances_when_that_beats_dropping_and_rebalances_back_on_recovery():
    ctx = _uniform_ctx(dp=2)  # 16 micro-batches on 2 pipelines of 2 stages; node 3 is stage 1 of the second
    plan = ctx.initial_plan(list(range(4)))
    expected = decide_slow(ctx.planner, plan, {3: 1.5})
    # by hand: carrying on takes 4 + 8 x 18 + 8 = 156 s; [10, 6] micro-batches take max(12 x 11, 12 + 6 x 18)
    # = 132 s; dropping node 3 leaves 3 nodes, one 3-stage pipeline of 16 micro-batches: 144 s
    by = {o.action: o.candidate for o in expected.options}
    assert (by["none"].step_time_s, by["rebalance"].step_time_s, by["drop"].step_time_s) == (156.0, 132.0, 144.0)
    assert expected.action == "rebalance"
    events = (ClusterEvent(1 * HOUR, slowdown=((3, 1.5),)), ClusterEvent(2 * HOUR, slowdown=((3, 1.0),)))
    policy, run = _run("odyssey", ctx, events)
    kinds = [(round(r.time_s / HOUR), r.kind) for r in run.reactions]
    assert kinds == [(0, "start"), (1, "rebalance"), (2, "rebalance")]
    assert run.reactions[1].transition_s == pytest.approx(10.0 + 156.0)  # rebuild + the redone step
    assert run.reactions[2].note.startswith("readmit")
    assert run.throughput_at(1.5 * HOUR) == pytest.approx(16 / 132.0)
    assert policy.plan.pipelines == plan.pipelines  # back to [8, 8]
    assert run.segments[-1].throughput == pytest.approx(ctx.cost.throughput(plan))


def test_a_slow_node_that_dies_is_no_longer_slow():
    ctx = _uniform_ctx()
    events = (ClusterEvent(1 * HOUR, slowdown=((5, 1.1),)), ClusterEvent(2 * HOUR, removed=frozenset({5})))
    policy, run = _run("odyssey-ignore-slow", ctx, events)
    assert policy.slowdown == {}
    assert run.segments[-1].throughput == pytest.approx(ctx.cost.throughput(policy.plan))


def test_fail_slow_runs_end_to_end_and_costs_the_ignoring_variant():
    cfg = small_config(fail_slow=(SlowClass("test", 0.3, 0.5, (3.0,)),), failure_rate=0.02,
                       policies=("odyssey", "odyssey-ignore-slow", "odyssey-slow-as-failure", "recycle"))
    res = run_simulation(cfg)
    thr = {n: s.avg_throughput for n, s in res.policies.items()}
    assert thr["odyssey"] > thr["odyssey-ignore-slow"]
    assert res.to_dict()["config"]["fail_slow"][0]["factors"] == (3.0,)
    plain = run_simulation(small_config(failure_rate=0.02, policies=("odyssey",)))
    assert plain.policies["odyssey"].avg_throughput > thr["odyssey-ignore-slow"]


def test_slow_spans_and_onsets_count_live_slow_nodes():
    from megatron_odyssey.sim.experiments import slow_onsets, slow_spans

    s = EventStream(frozenset(range(4)), (
        ClusterEvent(10.0, slowdown=((1, 2.0),)), ClusterEvent(20.0, slowdown=((2, 3.0), (1, 6.0))),
        ClusterEvent(30.0, removed=frozenset({2})), ClusterEvent(40.0, slowdown=((1, 1.0),))), 100.0)
    assert slow_onsets(s) == 2  # node 1's factor rising from 2 to 6 is the same episode (compounded)
    assert slow_spans(s) == [(10.0, 20.0, 1), (20.0, 30.0, 2), (30.0, 40.0, 1)]


def test_simulate_cli_takes_a_fail_slow_preset(capsys):
    import json

    from megatron_odyssey.cli import main

    argv = ["simulate", "--npus", "8", "--pp", "4", "--dp", "2", "--hours", "2", "--global-batch", "16",
            "--failure-rate", "0.05", "--fail-slow", "greyhound-severe", "--policies",
            "odyssey,odyssey-ignore-slow,odyssey-slow-as-failure", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert [c["name"] for c in out["config"]["fail_slow"]] == ["at-scale"]
    assert set(out["policies"]) == {"odyssey", "odyssey-ignore-slow", "odyssey-slow-as-failure"}
