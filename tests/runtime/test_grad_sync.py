"""Per-layer gradient all-reduce, overlapped with the backward (``--overlap-grad-reduce`` after a failure):
two real gloo ranks, the same backward with and without overlap."""
from __future__ import annotations

import torch
import torch.multiprocessing as mp

from _runtime_workers import overlapped_grad_sync_worker


def test_overlapped_all_reduces_start_inside_the_backward_highest_unit_first_and_sum_the_same(tmp_path):
    out = tmp_path / "result.pt"
    mp.spawn(overlapped_grad_sync_worker, args=(2, str(tmp_path / "store"), str(out)), nprocs=2, join=True)
    result = torch.load(out, weights_only=False)
    plain, overlapped = result[False], result[True]
    # each pass: bit for bit the sum of both ranks' complete local gradients (an all-reduce that started
    # before its unit's gradient was complete would sum a partial one); the passes agree up to rounding
    for run in (plain, overlapped):
        for i, reduced in enumerate(run["grads"]):
            assert torch.equal(reduced, run["local"][0][i] + run["local"][1][i]), i
    for a, b in zip(plain["grads"], overlapped["grads"]):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
    assert plain["joined"] == overlapped["joined"] == 4
    # without overlap every all-reduce starts after the backward; with it, every one starts inside it,
    # the output layer (unit 3, whose gradient is complete first) first and the embedding (unit 0) last
    assert all(entered >= plain["backward_end"] for _, entered, _ in plain["reductions"])
    assert all(entered < overlapped["backward_end"] for _, entered, _ in overlapped["reductions"])
    started = sorted(overlapped["reductions"], key=lambda r: r[1])
    assert [unit for unit, _, _ in started] == [3, 2, 1, 0]


def test_tied_embedding_copies_take_the_gradient_summed_over_every_copy_and_move_under_their_alias(tmp_path):
    """Tied embeddings on node 0 (one weight, the whole model), node 1 (embedding) and node 2 (output layer's
    copy): each copy ends with the sum of all three local gradients (node 0's counted once), and the other units
    are summed over their own holders only. Node 0 sends the output unit to node 2 as its embedding under the
    alias ``output_layer.weight``, and node 2's copy comes back to node 0 the same way (no hang, no mix-up)."""
    from _runtime_workers import tied_embeddings_worker

    out = tmp_path / "result.pt"
    mp.spawn(tied_embeddings_worker, args=(3, str(tmp_path / "store"), str(out)), nprocs=3, join=True)
    ranks = torch.load(out, weights_only=False)
    tied = {0: "embedding.word_embeddings.weight", 1: "embedding.word_embeddings.weight", 2: "output_layer.weight"}
    # local gradients: 10^rank x (position of the parameter in the rank's list + 1)
    local = {0: 1.0, 1: 10.0 * 1, 2: 100.0 * 4}
    for r in range(3):
        assert torch.equal(ranks[r]["grads"][tied[r]], torch.full((3,), sum(local.values())))
    # layer 0 on nodes 0 and 1; the final norm on nodes 0 and 2 (the tied copy is not in its unit's sum)
    assert torch.equal(ranks[1]["grads"]["decoder.layers.0.w"], torch.full((3,), 2.0 + 20.0))
    assert torch.equal(ranks[2]["grads"]["decoder.final_layernorm.weight"], torch.full((3,), 6.0 + 300.0))
    # node 0: layers 1-4 and the final norm (its unit 0 holds only the tied weight), and the pair; node 2: 3, 4, 5, pair
    assert ranks[0]["joined"] == 6 and ranks[2]["joined"] == 4
    # node 2 got node 0's single weight as its output layer's copy (value rank + 1 = 1); node 0 got node 2's
    assert torch.equal(ranks[2]["received"]["output_layer.weight"], torch.full((3,), 1.0))
    assert torch.equal(ranks[2]["received"]["decoder.final_layernorm.weight"], torch.full((3,), 1.0))
    assert torch.equal(ranks[0]["received"]["output_layer.weight"], torch.full((3,), 3.0))
