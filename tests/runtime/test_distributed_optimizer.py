"""Megatron's distributed optimizer through a failure, without Megatron-LM: which failure sets lose a shard
(hand-computed), and the full state assembled from the survivors' shares equals the state the shares were
cut from, or names what is missing. (Megatron-LM's own job with --use-distributed-optimizer is in
test_megatron_lm.py.)"""
from __future__ import annotations

import pytest
import torch

from megatron_odyssey.megatron_lm.distributed_optimizer import (Piece, ShardedState, ShardLost, _canonical, assemble,
                                                                shards_lost, stage_holder_groups, unit_holder_groups)
from megatron_odyssey.planning.plan import symmetric_plan
from megatron_odyssey.runtime.state import TIED_ALIASES


@pytest.mark.parametrize("dead, lost", [
    ({1}, []),  # shard 1 of stage 0 is also on replica 3
    ({1, 3}, [0]),  # replicas 1 and 3: both holders of stage 0's shard 1 (instances {0, 1} and {2, 3})
    ({1, 2}, []),  # shards 1 and 0 each keep one holder
    ({0, 1}, []),  # a whole instance: the other has every shard
    ({5, 7}, [1]),  # stage 1 (nodes 4..7): replicas 1 and 3
    ({0, 2, 5}, [0]),
])
def test_shards_lost_hand_computed(dead: set[int], lost: list[int]) -> None:
    # PP=2, DP=4, 2 instances of 2 ranks: node of (stage s, replica d) = 4 s + d; shard j on replicas j, j + 2
    assert shards_lost(2, 4, 2, dead) == lost


def test_three_instances_need_three_deaths() -> None:
    assert shards_lost(1, 6, 3, {0, 2}) == [] and shards_lost(1, 6, 3, {0, 2, 4}) == [0]


def test_stage_holder_groups_skip_the_dead_and_cover_every_tp_rank() -> None:
    rank_of = {(n, t): 10 * n + t for n in range(8) for t in range(2)}
    groups = stage_holder_groups(2, 4, 2, {0, 2, 3, 4, 5, 6, 7}, lambda n, t: rank_of[(n, t)])
    assert groups == [[0, 20, 30], [1, 21, 31], [40, 50, 60, 70], [41, 51, 61, 71]]


def _state(seed: int) -> dict[str, dict]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"layer.weight": (3, 5), "layer.bias": (5,)}
    return {n: {"param": torch.randn(s, generator=g), "exp_avg": torch.randn(s, generator=g),
                "exp_avg_sq": torch.rand(s, generator=g), "step": 7.0} for n, s in shapes.items()}


def _share(full: dict[str, dict], spans: dict[str, tuple[int, int]]) -> ShardedState:
    share = ShardedState({n: (st["param"].numel(), tuple(st["param"].shape)) for n, st in full.items()})
    for name, (a, b) in spans.items():
        st = full[name]
        share[name] = [Piece(a, b, st["param"].numel(), tuple(st["param"].shape),
                             *(st[k].reshape(-1)[a:b].clone() for k in ("param", "exp_avg", "exp_avg_sq")), st["step"])]
    return share


def test_assemble_equals_the_state_the_shares_were_cut_from() -> None:
    full = _state(0)
    # instance 0 shards the flat buffer as [0, 9) + [9, 15) of the weight and the bias; a replica repeats one
    shares = [_share(full, {"layer.weight": (0, 9)}), _share(full, {"layer.weight": (9, 15), "layer.bias": (0, 5)}),
              _share(full, {"layer.weight": (0, 9)})]
    out = assemble(shares)
    assert set(out) == set(full)
    for name, st in full.items():
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(out[name][key], st[key])
        assert out[name]["step"] == 7.0


def test_assemble_names_the_missing_elements() -> None:
    full = _state(1)
    shares = [_share(full, {"layer.weight": (0, 9), "layer.bias": (0, 5)})]
    with pytest.raises(ShardLost, match=r"layer.weight: elements 9\.\.14 of 15 were held only by dead ranks"):
        assemble(shares)


def test_assemble_refuses_disagreeing_step_counts() -> None:
    full = _state(2)
    a = _share(full, {"layer.weight": (0, 15), "layer.bias": (0, 2)})
    b = _share(full, {"layer.bias": (2, 5)})
    b["layer.bias"][0].step = 6.0
    with pytest.raises(RuntimeError, match="disagree on the Adam step count"):
        assemble([a, b])


TIED = ("embedding.word_embeddings.weight", "output_layer.weight")


def test_unit_holder_groups_gather_the_tied_weight_over_both_ends_last() -> None:
    """PP=2 x DP=2 after a failure (layers 0-1 on nodes 0, 1; layers 2-3 and the output on nodes 2, 3): one group
    per holder set, and with tied embeddings one more, last, of every live holder of either end; the shared
    weight leaves its units' groups for it, the position embeddings stay."""
    plan = symmetric_plan(2, 2, 4, 4)
    groups, parts = unit_holder_groups(plan, {0, 1, 2, 3}, 1, lambda n, t: n, 4, TIED)
    assert groups == [[0, 1], [2, 3], [0, 1, 2, 3]]
    first, last, tied = parts
    assert first("embedding.position_embeddings.weight") and not first(TIED[0])
    assert last("decoder.final_layernorm.weight") and not last(TIED[1])
    assert tied(TIED[0]) and tied(TIED[1]) and not tied("embedding.position_embeddings.weight")
    # node 1 dead: it is left out of every group; untied: no extra group
    assert unit_holder_groups(plan, {0, 2, 3}, 1, lambda n, t: n, 4, TIED)[0] == [[0], [2, 3], [0, 2, 3]]
    assert unit_holder_groups(plan, {0, 1, 2, 3}, 1, lambda n, t: n, 4)[0] == [[0, 1], [2, 3]]


def test_pieces_of_the_tied_weight_kept_under_either_name_assemble() -> None:
    """A first stage keeps shard [0, 9) of the word embeddings, a last stage shard [9, 15) of its copy (the output
    layer's weight): under one name (state.TIED_ALIASES) they are the whole state, given back under the name the
    rank has."""
    full = _state(2)["layer.weight"]
    first = _share({TIED[0]: full}, {TIED[0]: (0, 9)})
    last = _share({TIED[1]: full}, {TIED[1]: (9, 15)})
    renamed_first, none = _canonical(first, TIED_ALIASES)
    renamed_last, renamed = _canonical(last, TIED_ALIASES)
    assert none == {} and renamed == {TIED[1]: TIED[0]} and list(renamed_last.expected) == [TIED[0]]
    out = assemble([renamed_first, renamed_last])
    for key in ("param", "exp_avg", "exp_avg_sq"):
        assert torch.equal(out[TIED[0]][key], full[key])
