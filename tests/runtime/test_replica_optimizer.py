"""Megatron's optimizer after a failure, sharded over each unit's holders with a replica of every shard
(``--use-distributed-optimizer`` jobs; megatron_lm.replica_optimizer): three real gloo ranks and megatron-core's
own bf16 optimizer, cut down and plain, over the same gradients."""
from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from _runtime_workers import replica_optimizer_worker
from megatron_odyssey.megatron_lm.distributed_optimizer import ShardLost, assemble
from megatron_odyssey.planning.sharding import kept_shards, shard_bounds

WORLD = 3


DTYPES = ["bfloat16", "float32"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Both dtypes from one spawn (each process imports megatron-core once)."""
    tmp = tmp_path_factory.mktemp("replica")
    out = tmp / "result.pt"
    mp.spawn(replica_optimizer_worker, args=(WORLD, str(tmp / "store"), str(out), DTYPES), nprocs=WORLD, join=True)
    return torch.load(out, weights_only=False)


@pytest.fixture(params=DTYPES)
def result(request: pytest.FixtureRequest, results: dict) -> dict:
    """bf16: Megatron's Float16OptimizerWithFloat16Params (fp32 main copies); fp32: its FP32Optimizer."""
    return results[request.param]


def test_sharded_steps_give_the_plain_optimizers_weights_bit_for_bit(result: dict) -> None:
    """Three steps of AdamW with weight decay groups and clipping: after the all-gather every rank's weights
    are the plain optimizer's, exactly (Adam is elementwise)."""
    for name, want in result["plain_params"].items():
        assert torch.equal(result["sharded_params"][name], want), name


def test_each_rank_keeps_two_of_three_shards(result: dict) -> None:
    """Rank 0 keeps shards 0 and 1 of every parameter (its own and the next holder's): 2/3 of the state,
    not all of it, as the memory model (planning.sharding.optimizer_share) counts."""
    sizes = [(7 * 5), 13, 4, 5 * 3, 6 * 5]
    expected = sum(b - a for n in sizes for k in kept_shards(0, WORLD, 2) for a, b in [shard_bounds(n, WORLD)[k]])
    # by hand: 35 -> shards 12, 12, 11; 13 -> 5, 4, 4; 4 -> 2, 1, 1; 15 -> 5, 5, 5; 30 -> 10, 10, 10
    assert result["kept"] == expected == (12 + 12) + (5 + 4) + (2 + 1) + (5 + 5) + (10 + 10) == 66
    assert result["total"] == 97


@pytest.mark.parametrize("dead", [0, 1, 2])
def test_any_single_rank_lost_leaves_the_whole_state(result: dict, dead: int) -> None:
    """The survivors' pieces assemble into the plain optimizer's fp32 weights and Adam moments, exactly."""
    full = assemble([s for r, s in enumerate(result["shares"]) if r != dead])
    for name, want in result["reference"].items():
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(full[name][key], want[key]), (name, key)
        assert full[name]["step"] == float(want["step"]) == 3.0


def test_two_ranks_lost_lose_a_shard_and_say_which(result: dict) -> None:
    with pytest.raises(ShardLost, match="held only by dead ranks"):
        assemble([result["shares"][2]])


def test_checkpoints_are_the_distributed_optimizers_layout_free_format(result: dict) -> None:
    """Megatron's sharded_state_dict of the cut-down optimizer (gathered for the call) is what
    DistributedOptimizer writes as ``fully_reshardable``: every parameter's fp32 value and moments at its own
    shape under ``optimizer.state.<what>.<parameter key>``, and the groups with the step, so the job's own
    command line (--use-distributed-optimizer) relaunches from a checkpoint written after a failure."""
    assert result["common"]["param_state_sharding_type"] == "fully_reshardable"
    groups = result["common"]["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0] and all(g["step"] == 3.0 for g in groups)
    assert all("params" not in g for g in groups)
    saved = result["saved"]
    assert len(saved) == 3 * len(result["reference"])
    for name, want in result["reference"].items():
        assert torch.equal(saved[f"optimizer.state.param.{name}"], want["param"]), name
        assert torch.equal(saved[f"optimizer.state.exp_avg.{name}"], want["exp_avg"]), name
        assert torch.equal(saved[f"optimizer.state.exp_avg_sq.{name}"], want["exp_avg_sq"]), name


def test_the_checkpoint_loads_back_into_the_shards(result: dict) -> None:
    """Megatron's load path (sharded_state_dict(is_loading=True), then load_state_dict) fills each rank's
    kept shards: the pieces assemble into the saved state, step included."""
    full = assemble(result["loaded"])
    for name, want in result["reference"].items():
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(full[name][key], want[key]), (name, key)
        assert full[name]["step"] == 3.0
