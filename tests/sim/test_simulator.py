"""The simulator's contract: determinism, fault-free equality, bounds, ReCycle monotonicity, traces."""
from __future__ import annotations

import json
import math

import pytest

from megatron_odyssey.sim import TraceFormatError, run_simulation, write_outputs
from megatron_odyssey.sim.result import CONTRACT_RATIOS

from sim_helpers import small_config

ALL = ("odyssey", "odyssey-f1", "oobleck", "recycle", "recycle-nofill", "checkpoint", "fault-scaled")


def _without_wall(d):
    d = dict(d)
    d["info"] = {k: v for k, v in d["info"].items() if k != "wall_time_s"}
    return d


def test_same_seed_same_result():
    cfg = small_config(failure_rate=0.3, policies=ALL)
    a, b = run_simulation(cfg), run_simulation(cfg)
    assert json.dumps(_without_wall(a.to_dict())) == json.dumps(_without_wall(b.to_dict()))
    for name in ALL:
        assert [s for r in a.policies[name].runs for s in r.segments] == \
               [s for r in b.policies[name].runs for s in r.segments]


def test_different_seeds_differ():
    a = run_simulation(small_config(failure_rate=0.3, seeds=1, first_seed=0, policies=("recycle",)))
    b = run_simulation(small_config(failure_rate=0.3, seeds=1, first_seed=1, policies=("recycle",)))
    assert a.policies["recycle"].runs[0].segments != b.policies["recycle"].runs[0].segments


@pytest.mark.parametrize("save_s", [0.0, 30.0])
def test_no_failures_every_policy_equals_fault_free(save_s):
    res = run_simulation(small_config(failure_rate=0.0, checkpoint_save_s=save_s, policies=ALL))
    ff = res.fault_free_throughput
    assert ff > 0
    for name in ALL:
        for run in res.policies[name].runs:
            assert run.avg_throughput == pytest.approx(ff, rel=1e-12), name
            assert run.reconfigurations == 0
            assert run.lost_samples == 0
    if save_s:
        assert ff < res.policies["odyssey"].runs[0].segments[0].throughput  # the saves stall training


def _assert_bounded(res, bound_name, names, slack=1e-9):
    for name in names:
        for run, bound in zip(res.policies[name].runs, res.policies[bound_name].runs):
            for seg in run.segments:
                for t in (seg.start_s, (seg.start_s + seg.end_s) / 2):
                    assert seg.throughput <= bound.throughput_at(t) * (1 + slack) + 1e-12, (name, run.seed, t)


@pytest.mark.parametrize("rate", [0.05, 0.3])
def test_ideal_is_an_upper_bound_at_every_moment(rate):
    names = ALL[:-1]
    res = run_simulation(small_config(failure_rate=rate, seeds=3, policies=names + ("ideal",)))
    _assert_bounded(res, "ideal", names)


def test_fault_scaled_is_an_upper_bound_at_every_moment_without_recoverable_bubbles(tmp_path):
    """Fault-scaled (fault-free x fraction of devices alive) bounds every policy whenever no layout
    can beat the launched one per device: here pure data parallelism (PP=1, no bubbles) and free
    communication. With pipeline bubbles it is not a strict bound (a smaller cluster runs more
    micro-batches per pipeline, ReCycle fills bubbles); ``ideal`` is the bound then (test above)."""
    from megatron_odyssey.planning.profile import uniform_profile

    path = tmp_path / "uniform.json"
    uniform_profile(4, forward_s=0.1, backward_s=0.2).save(path)
    names = ALL[:-1]
    res = run_simulation(small_config(profile=str(path), num_layers=None, pp=1, dp=8, npus=8, global_batch=32,
                                      failure_rate=0.3, seeds=3, policies=names + ("fault-scaled",)))
    _assert_bounded(res, "fault-scaled", names)


@pytest.mark.parametrize("policy", ["recycle", "recycle-nofill"])
def test_recycle_throughput_never_rises_between_failures(policy):
    """A failure never speeds a rerouted grid up, unless ReCycle's failure normalisation moved workers
    to a better placement at that failure (the play sees which pipelines the failures hit: one whole
    dead pipeline couples fewer peers than two half-dead ones)."""
    res = run_simulation(small_config(failure_rate=0.4, seeds=4, policies=(policy,), hours=6.0))
    for run in res.policies[policy].runs:
        restarts = {r.time_s for r in run.reactions if r.kind == "restart" or "normalisation" in r.note}
        training = [s for s in run.segments if s.state == "training"]
        for a, b in zip(training, training[1:]):
            if any(a.end_s <= t <= b.start_s for t in restarts):
                continue  # a restart into a new grid starts a new story
            assert b.throughput <= a.throughput * (1 + 1e-12), (run.seed, a, b)


def test_failures_cost_throughput():
    res = run_simulation(small_config(failure_rate=0.3, policies=ALL))
    for name in ALL:
        assert res.policies[name].avg_throughput < res.fault_free_throughput


def test_json_contract():
    res = run_simulation(small_config(failure_rate=0.3, policies=("odyssey", "oobleck", "recycle", "fault-scaled")))
    d = json.loads(res.to_json())
    assert set(d) >= {"config", "policies", "ratios"}
    assert set(d["ratios"]) == set(CONTRACT_RATIOS)
    for name, p in d["policies"].items():
        assert {"avg_throughput", "samples", "downtime_s", "reconfigurations"} <= set(p)
    assert d["ratios"]["odyssey/oobleck"] == pytest.approx(
        d["policies"]["odyssey"]["avg_throughput"] / d["policies"]["oobleck"]["avg_throughput"])
    assert d["config"]["npus"] == 8


def test_ratio_is_null_when_a_policy_is_missing():
    d = json.loads(run_simulation(small_config(failure_rate=0.3, seeds=1, policies=("odyssey",))).to_json())
    assert d["ratios"]["odyssey/recycle"] is None


def test_write_outputs(tmp_path):
    res = run_simulation(small_config(failure_rate=0.3, seeds=1, policies=("odyssey", "recycle")))
    paths = write_outputs(res, tmp_path)
    names = {p.name for p in paths}
    assert {"result.json", "timeseries_odyssey.csv", "timeseries_recycle.csv", "devices.png", "throughput.png"} <= names
    header = (tmp_path / "timeseries_odyssey.csv").read_text().splitlines()[0]
    assert header == "time_s,devices_alive,devices_used,throughput,state"
    assert (tmp_path / "throughput.png").read_bytes()[:4] == b"\x89PNG"


# -- traces ---------------------------------------------------------------------------------------

def _trace(tmp_path, lines):
    p = tmp_path / "t.csv"
    p.write_text("\n".join(lines) + "\n")
    return str(p)


@pytest.mark.parametrize("bad, why", [
    ("60000,add", "fields"),
    ("sixty,add,node9", "integer"),
    ("60000,join,node9", "neither"),
    ("60000,add,9", "nodeNAME"),
    ("60000,remove,node42", "never added"),
    ("60000,add,node1", "already in the cluster"),
    ("-5,add,node9", "negative"),
])
def test_malformed_trace_line_stops_the_run_with_its_line_number(tmp_path, bad, why):
    good = [f"0,add,node{i}" for i in range(1, 9)]
    path = _trace(tmp_path, good + ["30000,remove,node3", bad, "90000,add,node3"])
    with pytest.raises(TraceFormatError) as info:
        run_simulation(small_config(trace=path, seeds=1))
    assert info.value.line_no == 10
    assert f"{path}:10:" in str(info.value)
    assert why in str(info.value)


def test_trace_time_going_back_is_an_error(tmp_path):
    path = _trace(tmp_path, ["0,add,node1", "5000,add,node2", "4000,add,node3"])
    with pytest.raises(TraceFormatError, match=r":3: time 4000 ms goes back"):
        run_simulation(small_config(trace=path, seeds=1))


def test_trace_that_starts_empty_waits_for_nodes(tmp_path):
    lines = [f"480000,add,node{i}" for i in range(1, 9)] + ["3600000,remove,node2", "5400000,add,node2"]
    res = run_simulation(small_config(trace=_trace(tmp_path, lines), seeds=1, policies=ALL))
    for name in ALL:
        run = res.policies[name].runs[0]
        assert run.segments[0].state == "waiting" and run.segments[0].end_s == pytest.approx(480.0), name
        assert run.throughput_at(100.0) == 0.0
        assert run.throughput_at(1000.0) > 0, name


def test_returning_nodes_are_used_again(tmp_path):
    lines = [f"0,add,node{i}" for i in range(1, 9)] + ["1800000,remove,node3", "1800000,remove,node6",
                                                       "3600000,add,node3", "3600000,add,node6"]
    res = run_simulation(small_config(trace=_trace(tmp_path, lines), seeds=1, hours=6.0,
                                      policies=("odyssey", "oobleck", "recycle", "checkpoint")))
    for name in ("odyssey", "oobleck", "recycle", "checkpoint"):
        run = res.policies[name].runs[0]
        assert run.segments[-1].devices_used == 8, name
    assert "fill" in res.policies["recycle"].runs[0].counts()


def test_trace_nodes_beyond_the_job_stay_idle(tmp_path):
    lines = [f"0,add,node{i}" for i in range(1, 13)] + ["1800000,remove,node1"]
    res = run_simulation(small_config(trace=_trace(tmp_path, lines), seeds=1, policies=("odyssey", "fault-scaled")))
    for name in ("odyssey", "fault-scaled"):
        run = res.policies[name].runs[0]
        assert run.segments[0].devices_alive == 12
        assert all(s.devices_used <= 8 for s in run.segments)
    assert res.policies["fault-scaled"].avg_throughput == pytest.approx(res.fault_free_throughput)


def test_interval_process_counts():
    res = run_simulation(small_config(failure_rate=None, failure_interval_h=0.5, seeds=3, policies=("recycle",)))
    n_fail = [sum(1 for r in run.reactions if r.kind != "start") for run in res.policies["recycle"].runs]
    assert all(1 <= n <= 20 for n in n_fail)


def test_paper_default_config_is_consistent():
    from megatron_odyssey.sim import SimulationConfig

    cfg = SimulationConfig()
    assert (cfg.npus, cfg.tp, cfg.pp, cfg.dp, cfg.failure_rate, cfg.hours, cfg.seeds) == (32, 1, 4, 8, 0.1, 9.0, 20)
    assert not math.isnan(cfg.horizon_s)


@pytest.mark.parametrize("batch", [16, 64])
def test_odyssey_ahead_of_recycle_and_oobleck_seed_for_seed_in_the_paper_setting(batch):
    """The paper's experiment (32 NPUs, (4, 8, 1), 10 %/NPU-h, 9 h), three seeds: with the filled reroute
    among its candidates, Odyssey is at least ReCycle and Oobleck on every seed (docs/simulation.md has
    20 seeds and where the margin is thin)."""
    from megatron_odyssey.sim import SimulationConfig

    res = run_simulation(SimulationConfig(global_batch=batch, seeds=3, progress=False,
                                          policies=("odyssey", "recycle", "oobleck")))
    for other in ("recycle", "oobleck"):
        assert min(res.seed_ratios("odyssey", other)) >= 1.0, (other, res.seed_ratios("odyssey", other))


def test_restart_risk_on_a_trace_prices_bursts(tmp_path):
    """Spot reclaims take several nodes at once: the trace's distribution of removals per event reaches
    the planner, so the risk of losing every copy of a layer in one event is priced."""
    from megatron_odyssey.sim.runner import derived_failure_bursts
    from megatron_odyssey.sim.traces import load_trace

    path = tmp_path / "t.csv"
    path.write_text("".join(f"0,add,node{i}\n" for i in range(8)) + "1000,remove,node0\n1000,remove,node1\n"
                    "2000,remove,node2\n3000,remove,node3\n3000,add,node0\n")
    trace = load_trace(path)
    cfg = small_config(trace=str(path), hours=1.0, failure_rate=None)
    assert derived_failure_bursts(cfg, trace) == ((1, 2 / 3), (2, 1 / 3))
    assert derived_failure_bursts(small_config(failure_rate=0.1), None) == ((1, 1.0),)
