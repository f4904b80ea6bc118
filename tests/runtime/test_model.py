"""Llama-style stage models over arbitrary layer ranges, global names, and TP sharding."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from _runtime_workers import make_batch, run_split
from megatron_odyssey.runtime import model as M
from megatron_odyssey.runtime.accelerator import seed_all

CFG = M.ModelConfig()  # 4 layers, hidden 64, 4 heads, ffn 128, seq 32, vocab 320


@pytest.fixture()
def batch() -> dict:
    return make_batch(CFG.vocab_size, CFG.seq_length)


def test_llama_architecture(gloo_world: None) -> None:
    seed_all(CFG.seed)
    m = M.build_stage_model(CFG, 0, CFG.num_layers)
    tc = m.config
    assert tc.normalization == "RMSNorm" and tc.gated_linear_unit and not tc.add_bias_linear
    assert tc.activation_func is torch.nn.functional.silu and m.position_embedding_type == "rope"
    assert not m.share_embeddings_and_output_weights
    assert m.embedding.word_embeddings.weight.data_ptr() != m.output_layer.weight.data_ptr()
    assert isinstance(m.decoder.final_layernorm, torch.nn.RMSNorm)
    assert all(p.dtype == torch.float32 for p in m.parameters())
    assert not any(n.endswith("bias") for n, _ in m.named_parameters())
    assert dict((n, tuple(p.shape)) for n, p in m.named_global_parameters()) == M.full_parameter_shapes(CFG)


@pytest.mark.parametrize("split", [1, 2, 3])
def test_split_stages_match_whole_model(gloo_world: None, batch: dict, split: int) -> None:
    """[0, L) == [0, k) then [k, L) composed by hand: same loss, same gradients."""
    seed_all(CFG.seed)
    whole = M.build_stage_model(CFG, 0, CFG.num_layers)
    loss_whole = run_split([whole], batch)

    first = M.build_stage_model(CFG, 0, split)
    second = M.build_stage_model(CFG, split, CFG.num_layers)
    assert first.pre_process and not first.post_process
    assert not second.pre_process and second.post_process
    assert [l.layer_number for l in second.decoder.layers] == list(range(split + 1, CFG.num_layers + 1))
    loss_split = run_split([first, second], batch)

    torch.testing.assert_close(loss_split, loss_whole, rtol=0, atol=1e-6)
    g_whole = whole.global_grads()
    g_split = {**first.global_grads(), **second.global_grads()}
    assert set(g_whole) == set(g_split)
    for name, g in g_whole.items():
        assert g.abs().sum() > 0, f"no gradient reached {name}"
        torch.testing.assert_close(g_split[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_three_uneven_stages(gloo_world: None, batch: dict) -> None:
    """A non-uniform plan ([0,1), [1,3), [3,6) of 6 layers) equals the whole model."""
    cfg = replace(CFG, num_layers=6)
    seed_all(cfg.seed)
    whole = M.build_stage_model(cfg, 0, 6)
    loss_whole = run_split([whole], batch)
    stages = [M.build_stage_model(cfg, a, b) for a, b in [(0, 1), (1, 3), (3, 6)]]
    assert not stages[1].pre_process and not stages[1].post_process
    loss = run_split(stages, batch)
    torch.testing.assert_close(loss, loss_whole, rtol=0, atol=1e-6)
    merged = {}
    for s in stages:
        merged.update(s.global_grads())
    for name, g in whole.global_grads().items():
        torch.testing.assert_close(merged[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_initialisation_is_plan_independent(gloo_world: None) -> None:
    seed_all(CFG.seed)
    ref = M.initial_full_state_dict(CFG)
    a = M.build_stage_model(CFG, 0, 4).global_state_dict()
    seed_all(999)  # the global RNG must not matter
    b = {**M.build_stage_model(CFG, 0, 3).global_state_dict(), **M.build_stage_model(CFG, 3, 4).global_state_dict()}
    for name, t in ref.items():
        assert torch.equal(a[name], t) and torch.equal(b[name], t), name
    # distinct layers / parameters get distinct values, other seeds other values
    assert not torch.equal(ref["decoder.layers.0.mlp.linear_fc1.weight"], ref["decoder.layers.1.mlp.linear_fc1.weight"])
    other = M.init_full_tensor(replace(CFG, seed=1), "decoder.layers.0.mlp.linear_fc1.weight", (256, 64))
    assert not torch.equal(other, ref["decoder.layers.0.mlp.linear_fc1.weight"])
    assert torch.all(ref["decoder.layers.2.input_layernorm.weight"] == 1)
    std_proj = ref["decoder.layers.0.self_attention.linear_proj.weight"].std().item()
    assert abs(std_proj - CFG.init_method_std / (2 * CFG.num_layers) ** 0.5) < 0.003


def test_global_names_round_trip() -> None:
    assert M.to_global_name("decoder.layers.1.mlp.linear_fc2.weight", 5) == "decoder.layers.6.mlp.linear_fc2.weight"
    assert M.to_global_name("module.module.output_layer.weight", 5) == "output_layer.weight"
    assert M.to_local_name("decoder.layers.6.mlp.linear_fc2.weight", 5, 8, False, True) == "decoder.layers.1.mlp.linear_fc2.weight"
    assert M.to_local_name("decoder.layers.8.mlp.linear_fc2.weight", 5, 8, False, True) is None
    assert M.to_local_name("embedding.word_embeddings.weight", 5, 8, False, True) is None
    assert M.to_local_name("output_layer.weight", 5, 8, False, True) == "output_layer.weight"
    assert M.global_layer_index("decoder.layers.12.input_layernorm.weight") == 12
    assert M.global_layer_index("decoder.final_layernorm.weight") is None


def test_state_moves_between_plans(gloo_world: None, batch: dict) -> None:
    """Train-ish perturbation on plan A, move the global state to plan B: same loss."""
    seed_all(CFG.seed)
    a = [M.build_stage_model(CFG, 0, 2), M.build_stage_model(CFG, 2, 4)]
    with torch.no_grad():
        for s in a:
            for _, p in s.named_global_parameters():
                p.add_(0.01 * torch.randn_like(p))
    state = {}
    for s in a:
        state.update(s.global_state_dict())
    loss_a = run_split(a, batch)

    b = [M.build_stage_model(CFG, 0, 1), M.build_stage_model(CFG, 1, 4)]
    for s in b:
        assert s.load_global_state_dict(state) == []
    torch.testing.assert_close(run_split(b, batch), loss_a, rtol=0, atol=1e-6)
    with pytest.raises(KeyError):
        b[0].load_global_state_dict({"output_layer.weight": state["output_layer.weight"]})


def test_partition_table_matches_megatron(gloo_world: None) -> None:
    """Our name-based TP layout agrees with the attributes megatron sets in its own init
    (``partition_dim``; ``partition_stride`` 2 marks the gated fc1), and StageGPTModel sets the
    same attributes although it skips megatron's init."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    seed_all(CFG.seed)
    tc = replace(M.make_transformer_config(CFG, CFG.num_layers), perform_initialization=True)
    ref = GPTModel(tc, get_gpt_layer_local_spec(normalization="RMSNorm"), CFG.vocab_size, CFG.seq_length,
                   position_embedding_type="rope", share_embeddings_and_output_weights=False)
    ours = dict(M.build_stage_model(CFG, 0, CFG.num_layers).named_global_parameters())
    for name, p in ref.named_parameters():
        part = M.tp_partition(name)
        if getattr(p, "tensor_model_parallel", False):
            assert part.dim == p.partition_dim and part.gated == (p.partition_stride == 2), name
        else:
            assert part.dim is None, name
        q = ours[name]
        assert getattr(q, "tensor_model_parallel", False) == getattr(p, "tensor_model_parallel", False), name
        if q.tensor_model_parallel:
            assert (q.partition_dim, q.partition_stride) == (p.partition_dim, p.partition_stride), name


@pytest.mark.parametrize("tp", [2, 4])
def test_scatter_merge_round_trip(tp: int) -> None:
    full_fc1 = torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3)  # [gate(8); up(8)]
    shards = [M.scatter_tp_tensor("decoder.layers.0.mlp.linear_fc1.weight", full_fc1, r, tp) for r in range(tp)]
    gate, up = full_fc1[:8], full_fc1[8:]
    k = 8 // tp
    assert torch.equal(shards[1], torch.cat([gate[k:2 * k], up[k:2 * k]]))  # [gate_r; up_r]
    assert torch.equal(M.merge_tp_shards("decoder.layers.0.mlp.linear_fc1.weight", shards), full_fc1)
    full_proj = torch.randn(4, 8)
    name = "decoder.layers.3.self_attention.linear_proj.weight"
    parts = [M.scatter_tp_tensor(name, full_proj, r, tp) for r in range(tp)]
    assert parts[0].shape == (4, 8 // tp) and torch.equal(M.merge_tp_shards(name, parts), full_proj)
    norm = torch.ones(4)
    assert M.scatter_tp_tensor("decoder.final_layernorm.weight", norm, 1, tp) is norm


def test_megatron_schedule_runs_on_cpu(gloo_world: None, batch: dict) -> None:
    """megatron's forward_backward_no_pipelining (token counting on device='cuda') in CPU mode."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    seed_all(CFG.seed)
    model = M.build_stage_model(CFG, 0, CFG.num_layers)

    def forward_step(data_iterator, model):  # type: ignore[no-untyped-def]
        b = next(data_iterator)
        out = M.stage_forward(model, b)

        def loss_func(output: torch.Tensor):  # type: ignore[no-untyped-def]
            loss = M.masked_lm_loss(output, b["loss_mask"])
            return loss, {"lm loss": loss.detach()}

        return out, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([batch, batch]), model=[model],
        num_microbatches=2, seq_length=CFG.seq_length, micro_batch_size=2, forward_only=False,
    )
    assert len(losses) == 2 and torch.isfinite(losses[0]["lm loss"])
    assert model.output_layer.weight.grad is not None


def test_megatron_1f1b_schedule_with_uneven_stages(two_rank_results: dict) -> None:
    """PP=2 with stages [0,1) and [1,L) through megatron's own 1F1B schedule and p2p (gloo,
    CPU mode): two identical micro-batches give the TP=1 single-batch loss and gradients
    (megatron divides each micro-batch loss by their number)."""
    res = two_rank_results
    assert len(res["pp2_losses"]) == 2
    for loss in res["pp2_losses"]:
        torch.testing.assert_close(loss, res["loss_tp1"], rtol=0, atol=1e-5)
    assert set(res["grads_pp2"]) == set(res["grads_tp1"])
    for name, g in res["grads_tp1"].items():
        torch.testing.assert_close(res["grads_pp2"][name], g, rtol=0, atol=1e-5, msg=name)


def test_tp2_matches_tp1_two_processes(two_rank_results: dict) -> None:
    """2 gloo processes: TP=2 (whole, and split [0,1)+[1,L)) gathered loss and gradients equal
    the TP=1 model's to 1e-5; gathered TP=2 initial weights equal the plan-independent ones."""
    res = two_rank_results
    assert res["params_match_init"]
    assert res["local_qkv_rows"] == 3 * CFG.hidden_size // 2  # really sharded
    torch.testing.assert_close(res["loss_tp2"], res["loss_tp1"], rtol=0, atol=1e-5)
    torch.testing.assert_close(res["loss_tp2_split"], res["loss_tp1"], rtol=0, atol=1e-5)
    assert set(res["grads_tp2"]) == set(res["grads_tp1"]) == set(res["grads_tp2_split"])
    for name, g in res["grads_tp1"].items():
        torch.testing.assert_close(res["grads_tp2"][name], g, rtol=0, atol=1e-5, msg=name)
        torch.testing.assert_close(res["grads_tp2_split"][name], g, rtol=0, atol=1e-5, msg=name)

