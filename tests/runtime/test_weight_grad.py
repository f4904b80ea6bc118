"""Decoupled back-propagation on megatron-core's own stage models: B (input gradient only) now, W
(the weight gradients B left behind) later, equal to one ordinary backward."""

from __future__ import annotations

import pytest
import torch

from _runtime_workers import make_batch
from megatron_odyssey.runtime import model as M
from megatron_odyssey.runtime.accelerator import seed_all
from megatron_odyssey.runtime.weight_grad import input_gradients_only

CFG = M.ModelConfig()  # 4 layers, hidden 64, 4 heads, ffn 128, seq 32, vocab 320


def _middle_and_last(batch: dict):
    """A middle stage [1, 3) and the last stage [3, 4), fed by stage [0, 1)'s real output."""
    seed_all(CFG.seed)
    first = M.build_stage_model(CFG, 0, 1)
    middle = M.build_stage_model(CFG, 1, 3)
    last = M.build_stage_model(CFG, 3, CFG.num_layers)
    with torch.no_grad():
        x = M.stage_forward(first, batch, None)
    return middle, last, x


def _step(middle, last, batches, decoupled: bool):
    """Two micro-batches through middle -> last; W of the first runs after B of the second."""
    grads_in, pending = [], []
    for batch, x in batches:
        inp = x.detach().requires_grad_()
        h = M.stage_forward(middle, batch, inp)
        h_in = h.detach().requires_grad_()
        loss = M.masked_lm_loss(M.stage_forward(last, batch, h_in), batch["loss_mask"])
        for out, grad, stage in ((loss, None, last), (h, "h_in", middle)):
            g = h_in.grad if grad == "h_in" else None
            if decoupled:
                with input_gradients_only() as w:
                    out.backward(g)
                pending.append(w)
            else:
                out.backward(g)
        grads_in.append(inp.grad.clone())
    for w in pending:
        w.apply()
    return grads_in


def test_b_then_w_equals_one_backward(gloo_world: None) -> None:
    data = [make_batch(CFG.vocab_size, CFG.seq_length, seed=s) for s in (1, 2)]
    middle, last, _ = _middle_and_last(data[0])
    ref_m, ref_l, _ = _middle_and_last(data[0])
    batches = [(b, _middle_and_last(b)[2]) for b in data]
    g_split = _step(middle, last, batches, decoupled=True)
    g_ref = _step(ref_m, ref_l, batches, decoupled=False)
    for a, b in zip(g_split, g_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # B computes the same input gradient
    for split, ref in ((middle, ref_m), (last, ref_l)):
        ga, gb = split.global_grads(), ref.global_grads()
        assert set(ga) == set(gb)
        for name in gb:
            assert gb[name].abs().sum() > 0, name
            torch.testing.assert_close(ga[name], gb[name], rtol=1e-6, atol=1e-7, msg=name)


def test_b_leaves_linear_weights_for_w(gloo_world: None) -> None:
    """After B alone, GEMM weights have no gradient yet and norms have theirs; W fills the rest."""
    batch = make_batch(CFG.vocab_size, CFG.seq_length, seed=3)
    middle, _, x = _middle_and_last(batch)
    inp = x.detach().requires_grad_()
    h = M.stage_forward(middle, batch, inp)
    with input_gradients_only() as w:
        h.backward(torch.ones_like(h))
    linear = {n for n, m in middle.named_modules() if type(m).__name__ in ("ColumnParallelLinear", "RowParallelLinear")}
    weights = {f"{n}.weight" for n in linear}
    assert weights and len(w.pending) == len(weights)
    for name, p in middle.named_parameters():
        assert (p.grad is None) == (name in weights), name
    assert inp.grad is not None and inp.grad.abs().sum() > 0
    w.apply()
    assert all(p.grad is not None for p in middle.parameters()) and not w.pending


def test_nesting_is_refused(gloo_world: None) -> None:
    with input_gradients_only():
        with pytest.raises(RuntimeError, match="does not nest"):
            with input_gradients_only():
                pass
