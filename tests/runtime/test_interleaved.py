"""The hand-off from Megatron's interleaved stages to the contiguous layout the planner describes
(hand-computed moves; the run through Megatron-LM is in test_megatron_lm.py)."""
from __future__ import annotations

import pytest
import torch

from megatron_odyssey.megatron_lm.interleaved import reshuffle_transfers, shapes_for_layers


def test_two_ranks_two_chunks() -> None:
    # 4 layers, PP=2, 2 chunks: rank 0 holds layers 0, 2; rank 1 holds 1, 3. Contiguous: rank 0 layers 0-1,
    # rank 1 layers 2-3. DP=2: node = 2 * pipeline rank + replica; node 1 (rank 0, replica 1) is dead.
    moves = reshuffle_transfers(4, 2, 2, 2, live={0, 2, 3})
    # layer 1 (unit 2) goes from rank 1's replicas to rank 0's live replica; layer 2 (unit 3) from rank 0's
    # live replica to both of rank 1's replicas
    assert moves == [(2, 2, 0), (3, 0, 2), (3, 0, 3)]


def test_sources_spread_over_live_replicas() -> None:
    moves = reshuffle_transfers(8, 2, 3, 2, live=set(range(6)))
    # 2 layers per chunk: rank 0 holds layers 0, 1, 4, 5 interleaved, rank 1 layers 2, 3, 6, 7; contiguous,
    # rank 0 takes layers 2, 3 (units 3, 4) from rank 1 and gives 4, 5; replica d takes from replica d
    assert [(u, s, d) for u, s, d in moves if u in (3, 4)] == [(3, 3, 0), (3, 4, 1), (3, 5, 2),
                                                               (4, 3, 0), (4, 4, 1), (4, 5, 2)]
    assert {u for u, _, _ in moves} == {3, 4, 5, 6}
    assert all(d // 3 == (u - 1) // 4 for u, _, d in moves)  # every destination is the contiguous owner


def test_uneven_virtual_stages_are_refused() -> None:
    with pytest.raises(ValueError, match="do not split into 2 x 2 equal virtual stages"):
        reshuffle_transfers(6, 2, 1, 2, live={0, 1})


def test_shapes_come_from_any_captured_layer() -> None:
    state = {"decoder.layers.0.mlp.linear_fc1.weight": {"param": torch.zeros(8, 4)},
             "decoder.layers.0.input_layernorm.weight": {"param": torch.zeros(4)},
             "embedding.word_embeddings.weight": {"param": torch.zeros(16, 4)}}
    assert shapes_for_layers(state, {1}) == {"decoder.layers.1.mlp.linear_fc1.weight": (8, 4),
                                             "decoder.layers.1.input_layernorm.weight": (4,)}
