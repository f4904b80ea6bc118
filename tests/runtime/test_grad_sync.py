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
