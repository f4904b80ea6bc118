"""Training on any plan equals fault-free single-process training (issue 4 acceptance).

Each case launches real processes over gloo with `odyssey train`'s launcher, then compares the
gathered parameters after 3 optimizer steps, and the per-step losses, with an independent
single-process reference run on the same global batches.
"""
from __future__ import annotations

import json

import pytest
import torch

from megatron_odyssey.planning.errors import PlanningError
from megatron_odyssey.planning.plan import layout, symmetric_plan
from megatron_odyssey.planning.planner import reroute_plan
from megatron_odyssey.runtime.config import TrainConfig
from megatron_odyssey.standalone.launcher import launch

TOL = 1e-5


def _train(cfg: TrainConfig, tmp_path):
    cfg.save_params = str(tmp_path / "params.pt")
    cfg.report = str(tmp_path / "report.json")
    launch(cfg, tmp_path / "run", quiet=True)
    return torch.load(cfg.save_params), json.loads((tmp_path / "report.json").read_text())


def _assert_matches(ref, params, report):
    assert set(params) == set(ref["params"])
    worst = max((params[k] - ref["params"][k]).abs().max().item() for k in params)
    assert worst < TOL, worst
    losses = [s["loss"] for s in report["steps"]]
    assert losses == pytest.approx(ref["losses"], abs=TOL)
    assert ref["losses"][-1] < ref["losses"][0]  # it actually trains


BASE = dict(layers=6, hidden=32, heads=4, seq=16, global_batch=12, micro_batch=1, steps=3, seed=7)


def test_symmetric_pp2_dp2(fault_free_reference, tmp_path):
    cfg = TrainConfig(nproc=4, tp=1, pp=2, **{**BASE, "global_batch": 8})
    params, report = _train(cfg, tmp_path)
    _assert_matches(fault_free_reference(cfg), params, report)


def test_rerouted_plan_one_of_six_nodes_dead(fault_free_reference, tmp_path):
    plan = reroute_plan(symmetric_plan(2, 3, 6, 12), frozenset({4}))  # stage 1 of replica 1 is dead
    cfg = TrainConfig(nproc=6, tp=1, pp=2, plan=plan.to_dict(), **BASE)
    params, report = _train(cfg, tmp_path)
    assert report["steps"][0]["alive"] == 5
    _assert_matches(fault_free_reference(cfg), params, report)


def test_two_pipelines_share_one_link_in_different_orders(fault_free_reference, tmp_path):
    """Stage 0 of replica 0 and stage 1 of replica 1 are dead: node 1 runs both pipelines' stage 0 and
    node 2 both pipelines' stage 1, so link 1 -> 2 carries both pipelines' activations, and node 2 runs
    them in a different order than node 1 sends them (equal fault-free slots, ownership breaks the tie).
    Messages carry no tags (as under NCCL): the receiver must take them in the sender's order."""
    from megatron_odyssey.planning.schedule import node_operations, pair_messages

    plan = reroute_plan(symmetric_plan(2, 2, 6, 8), frozenset({0, 3}))
    sent = pair_messages(plan)[(1, 2)]
    wanted = [("F", op.pipeline, op.stage - 1, op.micro_batch) for op in node_operations(plan)[2] if op.kind == "F"]
    assert sorted(sent) == sorted(wanted) and sent != wanted  # the case needs in-sender-order receipt
    cfg = TrainConfig(nproc=4, tp=1, pp=2, plan=plan.to_dict(), **{**BASE, "global_batch": 8})
    params, report = _train(cfg, tmp_path)
    _assert_matches(fault_free_reference(cfg), params, report)


def test_asymmetric_pipelines_2_2_3_with_uneven_splits(fault_free_reference, tmp_path):
    plan = layout([((2, 4), 4), ((4, 2), 3), ((1, 3, 2), 5)])  # 7 nodes, uneven layers and micro-batches
    cfg = TrainConfig(nproc=7, tp=1, pp=2, plan=plan.to_dict(), **BASE)
    params, report = _train(cfg, tmp_path)
    _assert_matches(fault_free_reference(cfg), params, report)


def test_tensor_parallel_inside_a_rerouted_plan(fault_free_reference, tmp_path):
    plan = reroute_plan(symmetric_plan(2, 2, 6, 12), frozenset({1}))  # 4 nodes x TP=2, one node dead
    cfg = TrainConfig(nproc=8, tp=2, pp=2, plan=plan.to_dict(), **BASE)
    params, report = _train(cfg, tmp_path)
    _assert_matches(fault_free_reference(cfg), params, report)


def test_filled_rerouted_plan_with_tensor_parallelism(fault_free_reference, tmp_path):
    """Bubble filling under TP=2: B's input gradient is all-reduced over the TP group, W stays local."""
    from dataclasses import replace

    plan = replace(reroute_plan(symmetric_plan(2, 2, 6, 12), frozenset({1})), fill=True)  # 4 nodes x TP=2
    cfg = TrainConfig(nproc=8, tp=2, pp=2, plan=plan.to_dict(), **BASE)
    params, report = _train(cfg, tmp_path)
    assert report["steps"][0]["alive"] == 6
    _assert_matches(fault_free_reference(cfg), params, report)


@pytest.mark.parametrize("plan,message", [
    (layout([((2, 3), 6), ((3, 3), 6)], num_layers=6), "pipeline 0 covers layers [0,5) but the model has 6"),
    (layout([((3, 3), 6), ((3, 3), 6)], nodes=[0, 1, 2, 9]), "names node 9, which does not exist"),
])
def test_bad_plans_are_rejected_before_any_process_starts(plan, message, tmp_path):
    cfg = TrainConfig(nproc=4, tp=1, pp=2, plan=plan.to_dict(), **BASE)
    with pytest.raises(PlanningError) as err:
        launch(cfg, tmp_path)
    assert message in str(err.value)
    assert not (tmp_path / "config.json").exists()  # nothing was started


def test_bad_flags_are_rejected_before_any_process_starts(tmp_path):
    with pytest.raises(PlanningError, match="--global-batch 10 is not divisible by --micro-batch x DP"):
        launch(TrainConfig(nproc=6, tp=1, pp=2, **{**BASE, "global_batch": 10}), tmp_path)
