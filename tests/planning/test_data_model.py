"""JSON round trips with schema versions, and plan validation."""
import pytest

from megatron_odyssey.planning.cluster import node_ranks
from megatron_odyssey.planning.errors import PlanningError
from megatron_odyssey.planning.plan import ExecutionPlan, Pipeline, Stage, layout, symmetric_plan
from megatron_odyssey.planning.planner import reroute_plan
from megatron_odyssey.planning.profile import ModelProfile, builtin_profile


def test_profile_round_trip(tmp_path):
    prof = builtin_profile(num_layers=4, tp=2)
    path = tmp_path / "p.json"
    prof.save(path)
    assert ModelProfile.load(path) == prof


def test_profile_rejects_unknown_and_missing_fields():
    data = builtin_profile(num_layers=2).to_dict()
    data["layers"][1]["flops"] = 3
    with pytest.raises(PlanningError, match=r"layers\[1\]: unknown profile field\(s\) \['flops'\]"):
        ModelProfile.from_dict(data)
    data = builtin_profile(num_layers=2).to_dict()
    del data["p2p_s"]
    with pytest.raises(PlanningError, match=r"missing field\(s\) \['p2p_s'\]"):
        ModelProfile.from_dict(data)
    data = builtin_profile(num_layers=2).to_dict()
    data["schema_version"] = 99
    with pytest.raises(PlanningError, match="schema_version 99"):
        ModelProfile.from_dict(data)


def test_plan_round_trip_keeps_id():
    plan = reroute_plan(symmetric_plan(2, 3, 8, 12), frozenset({4}))
    again = ExecutionPlan.from_dict(plan.to_dict())
    assert again == plan and again.plan_id == plan.plan_id


@pytest.mark.parametrize("plan,message", [
    (ExecutionPlan("reconfigure", 4, (Pipeline((Stage(0, 0, 2), Stage(1, 3, 4)), 2),)), "must start at layer 2"),
    (ExecutionPlan("reconfigure", 4, (Pipeline((Stage(0, 0, 2),), 2),)), "covers layers [0,2) but the model has 4"),
    (ExecutionPlan("reconfigure", 4, (Pipeline((Stage(0, 0, 4),), 2), Pipeline((Stage(0, 0, 4),), 2))), "appears twice"),
    (ExecutionPlan("reconfigure", 4, (Pipeline((Stage(0, 0, 4),), 0),)), "needs at least one"),
    (layout([((2, 2), 2)], nodes=[0, 17]), "names node 17, which does not exist"),
    (ExecutionPlan("reroute", 4, symmetric_plan(2, 2, 4, 4).pipelines, failed=frozenset({1})), "has no peer"),
])
def test_plans_that_cannot_run_are_rejected(plan, message):
    with pytest.raises(PlanningError) as err:
        plan.validate(valid_nodes=range(4))
    assert message in str(err.value)


def test_global_batch_mismatch_is_rejected():
    with pytest.raises(PlanningError, match="plan runs 4 micro-batches per step, the global batch has 8"):
        symmetric_plan(2, 2, 4, 4).validate(num_micro_batches=8)


def test_a_node_is_its_tensor_parallel_ranks_in_launch_order():
    assert node_ranks([0, 2], 2) == [0, 1, 4, 5] and node_ranks([3, 1], 1) == [3, 1] and node_ranks([], 4) == []
