"""Who writes what in a torch_dist checkpoint after a recovery (megatron_lm.checkpoint), with
megatron-core's own sharded objects and its own validation of a save's access pattern. The save and a
stock resume through Megatron-LM's pretrain_gpt.py are in test_megatron_lm.py (needs a checkout)."""
from __future__ import annotations

import pytest
import torch

from megatron_odyssey.megatron_lm.checkpoint import (mark_replicas, rng_state_objects, rng_writers,
                                                     sharded_unit)
from megatron_odyssey.planning.plan import symmetric_plan
from megatron_odyssey.planning.planner import reroute_plan

mapping = pytest.importorskip("megatron.core.dist_checkpointing.mapping")
from megatron.core.dist_checkpointing.validation import _validate_objects_for_key, _validate_sharding_for_key  # noqa: E402

LAYERS, PP, DP = 4, 2, 2


def test_units_of_checkpoint_keys() -> None:
    assert sharded_unit("embedding.word_embeddings.weight", (0, 0), LAYERS) == 0
    assert sharded_unit("decoder.layers.mlp.linear_fc1.weight", (2, 0, 0), LAYERS) == 3  # stacked: layer on axis 0
    assert sharded_unit("decoder.layers.3.mlp.linear_fc1.weight", (0, 0), LAYERS) == 4  # non-homogeneous: in the key
    assert sharded_unit("decoder.layers.self_attention.linear_proj._extra_state/shard_1_4", (1,), LAYERS) == 2
    assert sharded_unit("decoder.final_layernorm.weight", (0,), LAYERS) == LAYERS + 1
    assert sharded_unit("output_layer.weight", (0, 0), LAYERS) == LAYERS + 1


def _layer_tensors(plan, node: int, replica_id=(0, 0, 0)) -> list:
    """What every holder of a layer produces under our parallel_state (data-parallel rank 0 everywhere)."""
    out = []
    for unit in sorted(plan.holdings()[node]):
        if 1 <= unit <= LAYERS:
            out.append(mapping.ShardedTensor.from_rank_offsets(
                "decoder.layers.mlp.linear_fc2.weight", torch.zeros(3, 2), (0, unit - 1, LAYERS), replica_id=replica_id,
                prepend_axis_num=1))
    return out


@pytest.mark.parametrize("dead", [[1], [3], [1, 2]])
def test_every_layer_has_exactly_one_writer_after_a_reroute(dead: list[int]) -> None:
    plan = reroute_plan(symmetric_plan(PP, DP, LAYERS, 4), dead)
    by_node = {n: _layer_tensors(plan, n) for n in plan.live_nodes()}
    shardings = [(rank, t) for rank, ts in enumerate(by_node.values()) for t in ts]
    if any(len(h) > 1 for h in plan.holders().values()):
        with pytest.raises(Exception, match="Invalid access pattern"):  # Megatron's own replica ids: duplicates
            _validate_sharding_for_key(shardings)
    for node, ts in by_node.items():
        mark_replicas(ts, plan.holders(), node, LAYERS)
    _validate_sharding_for_key(shardings)  # each layer's element written once
    for node, ts in by_node.items():
        for t in ts:
            owner = min(plan.holders()[t.global_offset[0] + 1])
            assert (t.replica_id == (0, 0, 0)) == (node == owner)


def test_rng_slots_keep_the_original_layout() -> None:
    plan = reroute_plan(symmetric_plan(PP, DP, LAYERS, 4), [1])
    launch = symmetric_plan(PP, DP, LAYERS, 4)
    assert rng_writers(plan, launch) == {0: 0, 1: 2}
    objects = [(n, o) for n in plan.live_nodes()
               for o in rng_state_objects({"state": n}, rng_writers(plan, launch), n, 0, 1)]
    assert sorted(o.global_offset for _, o in objects) == [(0, 0), (1, 0)]
    assert all(o.global_shape == (PP, 1) for _, o in objects)
    _validate_objects_for_key(objects)  # Megatron's check: every slot once


def test_rng_slot_of_a_dead_stage_goes_to_the_owner_of_its_first_layer() -> None:
    """Every node of stage 1 of a PP=2 x DP=3 job (3, 4, 5) is gone and the stage-0 nodes were
    re-arranged: stage 1's slot goes to node 1, the lowest live holder of layer 2."""
    from megatron_odyssey.planning.plan import ExecutionPlan, Pipeline, Stage

    plan = ExecutionPlan("reconfigure", LAYERS, (Pipeline((Stage(0, 0, 2), Stage(2, 2, 4)), 3),
                                                 Pipeline((Stage(1, 0, 4),), 3)))
    assert rng_writers(plan, symmetric_plan(PP, 3, LAYERS, 3)) == {0: 0, 1: 1}


def test_rng_slot_of_a_dead_stage_follows_the_launchs_uneven_split() -> None:
    """As above, with the launch's layers split 3 + 1 (--decoder-first-pipeline-num-layers 3): stage 1 began at
    layer 3, whose lowest live holder is node 0; under the uniform split it would be layer 2's, node 1."""
    from megatron_odyssey.planning.plan import ExecutionPlan, Pipeline, Stage

    plan = ExecutionPlan("reconfigure", LAYERS, (Pipeline((Stage(1, 0, 3), Stage(0, 3, 4)), 3),
                                                 Pipeline((Stage(2, 0, 4),), 3)))
    assert rng_writers(plan, symmetric_plan(PP, 3, LAYERS, 3, layer_split=(3, 1))) == {0: 0, 1: 0}
    assert rng_writers(plan, symmetric_plan(PP, 3, LAYERS, 3)) == {0: 0, 1: 1}


def test_the_launch_plan_takes_the_launchs_layer_split() -> None:
    """TrainConfig.layer_split (a Megatron-LM job's uneven split, read at start-up) is generation 0's plan, for the
    agent and every rank; a split that does not give each stage a layer of the model is refused, naming it."""
    from megatron_odyssey.planning.errors import PlanningError
    from megatron_odyssey.runtime.config import TrainConfig

    cfg = TrainConfig(nproc=4, pp=2, layers=4, global_batch=8, layer_split=[3, 1])
    assert [[(s.node, s.layer_start, s.layer_end) for s in p.stages] for p in cfg.validate().pipelines] == \
        [[(0, 0, 3), (2, 3, 4)], [(1, 0, 3), (3, 3, 4)]]
    assert TrainConfig(nproc=4, pp=2, layers=4, global_batch=8).launch_plan().pipelines[0].layer_split() == (2, 2)
    for bad in ([4, 0], [2, 1], [1, 1, 2]):
        with pytest.raises(PlanningError, match=rf"layer split \[{', '.join(map(str, bad))}\] does not give"):
            TrainConfig(nproc=4, pp=2, layers=4, global_batch=8, layer_split=bad).validate()


@pytest.mark.parametrize("release_layout", ["stage x TP (to core_r0.13.0)", "world (core_r0.14.0 on)"])
def test_the_rerun_state_keeps_the_launch_layout_in_saves_and_loads(release_layout: str) -> None:
    """Megatron's rerun state machine entry after node 1 of a PP=2 x DP=2 job died (a reroute), from what Megatron
    builds under our one-rank parallel_state. Saves: every slot of the launch layout is written once by a live
    rank (megatron-core's own validation), so a relaunch at the launch size finds them all. Loads (an in-process
    restart from a checkpoint written before the failure): the ranks ask for every slot once too (Megatron checks
    a load's pattern as a save's), each its own slot first, the one it loads. Before, a core_r0.13.0 restart asked
    for "shard_1_4" where the checkpoint held "shard_0.0_2.1"."""
    from types import SimpleNamespace

    from megatron_odyssey.megatron_lm.checkpoint import original_layout_rerun_state, own_rerun_state

    plan = reroute_plan(symmetric_plan(PP, DP, LAYERS, 4), [1])
    stage_tp = release_layout.startswith("stage")
    cfg = SimpleNamespace(pp=PP, dp=DP, tp=1, layers=LAYERS)

    def entry(node: int, loading: bool):
        runtime = SimpleNamespace(cfg=cfg, plan=plan, gen0_plan=symmetric_plan(PP, DP, LAYERS, 4), node=node,
                                  tp_rank=0, ident=node,
                                  rank_map=SimpleNamespace(live_nodes=plan.live_nodes()))
        built = mapping.ShardedObject("rerun_state_machine_state", {"node": node}, (1, 1) if stage_tp else (1,),
                                      (0, 0) if stage_tp else (0,), replica_id=0)
        return original_layout_rerun_state({"mode": "disabled", "sharded": built}, runtime, loading)["sharded"]

    saved = [(n, o) for n in plan.live_nodes() for o in entry(n, loading=False)]
    launch = [(0, 0), (1, 0)] if stage_tp else [(r,) for r in range(PP * DP)]
    assert sorted(o.global_offset for _, o in saved) == launch
    assert all(o.global_shape == ((PP, 1) if stage_tp else (PP * DP,)) for _, o in saved)
    _validate_objects_for_key(saved)  # Megatron's check: every slot once
    asked = [(n, o) for n in plan.live_nodes() for o in entry(n, loading=True)]
    _validate_objects_for_key(asked)  # (a load checks the same access pattern)
    for node in plan.live_nodes():
        first = entry(node, loading=True)[0]  # the one loaded (own_rerun_state): the rank's launch slot
        assert first.global_offset == ((node // DP, 0) if stage_tp else (node,))
        loaded = own_rerun_state({"mode": "disabled", "sharded": [{"node": node}, {"node": -1}]})
        assert loaded == {"mode": "disabled", "sharded": {"node": node}}


def test_the_job_names_its_optimizer_format_only_where_its_release_does_not_record_it() -> None:
    """core_r0.12.0's checkpoints do not say how they hold the distributed optimizer's state (content metadata came
    in 0.13): the job says it from its flags, by that release's rule in save_checkpoint, so that a stop names it."""
    from types import SimpleNamespace

    from megatron_odyssey.megatron_lm.checkpoint import unrecorded_optimizer_format
    from megatron_odyssey.megatron_lm.versions import MegatronVersion

    def args(**kw):
        return SimpleNamespace(**{"use_distributed_optimizer": True, "ckpt_format": "torch_dist",
                                  "ckpt_fully_parallel_save": True, **kw})

    old, new = MegatronVersion(0, 12, 0), MegatronVersion(0, 13, 0)
    assert unrecorded_optimizer_format(args(), old) == "fully_sharded_model_space"
    assert unrecorded_optimizer_format(args(ckpt_fully_parallel_save=False), old) == "dp_zero_gather_scatter"
    assert unrecorded_optimizer_format(args(use_distributed_optimizer=False), old) is None
    assert unrecorded_optimizer_format(args(ckpt_format="torch"), old) is None
    assert unrecorded_optimizer_format(args(), new) is None  # its checkpoint says
    assert unrecorded_optimizer_format(args(), None) is None
