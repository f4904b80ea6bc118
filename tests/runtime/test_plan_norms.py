"""The whole model's gradient norm, parameter norm and zero count over a re-arranged plan (megatron_lm.plan_norms),
on three real gloo ranks, against the figures worked out by hand."""
from __future__ import annotations

import math

import torch
import torch.multiprocessing as mp

from _runtime_workers import plan_norms_worker


def test_every_unit_is_counted_once_by_its_lowest_holder_and_a_tied_copy_not_at_all(tmp_path) -> None:
    """Node 2 holds the whole model, nodes 0 and 1 a pipeline of two stages: every unit is counted by node 0 or 1
    (the lowest holder), none by node 2, and node 1's output layer, marked ``shared`` (the tied copy of the word
    embeddings), by nobody. Every rank gets the same figures, exact."""
    out = tmp_path / "norms.pt"
    mp.spawn(plan_norms_worker, args=(3, str(tmp_path / "store"), str(out)), nprocs=3, join=True)
    everyone = torch.load(out, weights_only=False)
    assert everyone[0]["owners"] == {0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 1}
    counted = {0: [1, 2, 3], 1: [1, 2, 3]}  # (k + 1) of the parameters counted on node 0 and node 1 (not the tied)
    squares = sum(((k * (r + 1)) ** 2) * sum(i * i for i in range(6)) for r, ks in counted.items() for k in ks)
    weights = sum(len(ks) * 6 * (r + 1) ** 2 for r, ks in counted.items())
    zeros = sum(len(ks) for ks in counted.values())  # each gradient's one zero
    for seen in everyone:
        grad, params, zero_count = seen["got"]
        assert grad == math.sqrt(squares) and params == math.sqrt(weights) and zero_count == zeros
