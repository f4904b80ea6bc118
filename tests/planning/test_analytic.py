"""The analytic profile (FLOPs, bytes, activations at the job's precision on the job's device), its
calibration to a measured step, and the planner's choice on real H100-class shapes: restart only
when a layer has no live copy left."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from megatron_odyssey.planning.analytic import BF16, FP32, DeviceParams, ModelShape, analytic_profile
from megatron_odyssey.planning.calibration import calibrate
from megatron_odyssey.planning.devices import Layout, device_params
from megatron_odyssey.planning.errors import PlanningError
from megatron_odyssey.planning.estimator import estimate_step
from megatron_odyssey.planning.plan import symmetric_plan
from megatron_odyssey.planning.planner import Planner, PlannerOptions

GiB = 2**30
# Llama-2-70B (hidden 8192, SwiGLU 28672, 64 heads in 8 KV groups, 80 layers), Llama-2's 4M-token batch
L70 = dict(num_layers=80, hidden=8192, ffn_hidden=28672, heads=64, query_groups=8, vocab=32000,
           seq_length=4096, micro_batch=1)
L7 = dict(num_layers=32, hidden=4096, ffn_hidden=11008, heads=32, query_groups=32, vocab=32000,
          seq_length=4096, micro_batch=1)


def h100(tp: int, dp: int, pp: int, **kw) -> DeviceParams:
    """80 GB H100 in 8-GPU servers, a layer at ~300 TFLOP/s (measured: 299 on the 70B shape), the
    cuda kind's links (NVLink inside a server, 25 GB/s IB between)."""
    return replace(device_params("cuda", Layout(tp, dp, pp, ranks_per_node=8), name="h100", flops=790e12,
                                 memory_bytes=80 * GiB, **kw), layer_efficiency=300 / 790)


def test_one_layer_of_70b_matches_the_hand_computed_formulas() -> None:
    shape = ModelShape(**L70, tp=8, sequence_parallel=True, flash_attention=True)
    dev = h100(8, 2, 8)
    prof = analytic_profile(shape, BF16, dev)
    h, f, kv, s = 8192, 28672, 1024, 4096
    fwd_flops = 2 * s * (h * (h + 2 * kv) + h * h) + 4 * s * s * h + 6 * s * h * f
    assert fwd_flops == 7_559_142_440_960  # 1.237e12 QKV+proj, 5.50e11 attention, 5.77e12 MLP
    layer = prof.layers[0]
    rate = 790e12 * (300 / 790) * 8 * 0.9
    assert layer.forward_s == pytest.approx(fwd_flops / rate, rel=1e-12)
    assert layer.backward_s == pytest.approx(2 * fwd_flops / rate, rel=1e-12)
    split = h * (h + 2 * kv) + h * h + 3 * h * f  # 855,638,016 split over TP=8
    params = split // 8 + 2 * h  # + two RMSNorm weights on every TP rank
    assert params == 106_971_136
    assert (layer.param_bytes, layer.grad_bytes, layer.optimizer_bytes) == (2 * params, 4 * params, 12 * params)
    # bf16: 4*s*h norm ins/outs (sequence parallel: / TP) + s*(2h + 2kv + 3f) / TP, 2 bytes each
    assert layer.activation_bytes == (4 * s * h * 2) // 8 + (s * (2 * h + 2 * kv + 3 * f) * 2) // 8 == 140_509_184
    assert layer.optimizer_s == pytest.approx(30 * params / dev.memory_bandwidth_Bps)
    assert prof.output.forward_s == pytest.approx(2 * s * h * 32000 / rate)
    assert prof.output.activation_bytes == 4 * s * 32000 // 8  # fp32 logits for the loss
    assert prof.p2p_s == pytest.approx(s * h * 2 / 8 / 25e9 + 20e-6)  # between servers
    assert prof.allreduce_bandwidth_Bps == 25e9  # TP x DP = 16 ranks span two servers
    assert prof.device_memory_bytes == int(80 * GiB * 0.9)


def test_unfused_attention_keeps_softmax_and_dropout_masks() -> None:
    flash = ModelShape(**L7, tp=1)
    unfused = replace(flash, flash_attention=False, attention_dropout=True, hidden_dropout=True)
    a, b = (analytic_profile(x, BF16, h100(1, 4, 4)).layers[0].activation_bytes for x in (flash, unfused))
    assert b - a == 32 * 4096 * 4096 * (2 + 1) + 2 * 4096 * 4096


def test_fp32_bytes_and_gelu_bias_layernorm_counts() -> None:
    shape = ModelShape(num_layers=2, hidden=64, ffn_hidden=256, heads=4, query_groups=4, vocab=320, seq_length=32,
                       micro_batch=2, swiglu=False, bias=True, layernorm=True, tp=2)
    cpu = device_params("cpu", Layout(2, 1, 1, 8))
    layer = analytic_profile(shape, FP32, cpu).layers[0]
    split = 64 * (64 + 128) + 64 * 64 + 2 * 64 * 256 + (64 + 128) + 256
    replicated = 4 * 64 + 2 * 64
    params = split // 2 + replicated
    assert (layer.param_bytes, layer.grad_bytes, layer.optimizer_bytes) == (4 * params, 4 * params, 8 * params)
    fwd = 2 * 2 * 32 * (64 * 192 + 64 * 64) + 4 * 2 * 32 * 32 * 64 + 4 * 2 * 32 * 64 * 256
    assert layer.forward_s == pytest.approx(fwd / (5e9 * 2))


def test_link_flags_override_the_defaults_and_bad_values_name_the_flag() -> None:
    dev = device_params("cuda", Layout(8, 2, 8, 8), flops=1e15, memory_bytes=80 * GiB,
                        p2p_GBps=50, allreduce_GBps=40, transfer_GBps=12.5)
    assert (dev.p2p_bandwidth_Bps, dev.allreduce_bandwidth_Bps, dev.transfer_bandwidth_Bps) == (50e9, 40e9, 12.5e9)
    inside = device_params("cuda", Layout(1, 8, 1, 8), flops=1e15, memory_bytes=80 * GiB)
    assert inside.allreduce_bandwidth_Bps == inside.p2p_bandwidth_Bps == 150e9  # one server: NVLink
    with pytest.raises(PlanningError, match="--odyssey-allreduce-bandwidth"):
        device_params("cuda", Layout(1, 8, 1, 8), flops=1e15, memory_bytes=80 * GiB, allreduce_GBps=-1)
    with pytest.raises(PlanningError, match="memory"):
        device_params("cuda", Layout(1, 8, 1, 8), flops=1e15)


def test_calibration_reproduces_the_measured_step() -> None:
    shape = ModelShape(**{**L7, "num_layers": 8}, tp=1)
    prof = analytic_profile(shape, BF16, h100(1, 2, 4))
    plan = symmetric_plan(4, 2, 8, 16)
    base = estimate_step(plan, prof)
    for measured in (0.5 * base.compute_s, 3.0 * (base.compute_s + base.sync_s)):
        cal = calibrate(prof, plan, measured)
        est = estimate_step(plan, cal.profile)
        assert est.compute_s + est.sync_s == pytest.approx(measured, rel=1e-6)
        assert cal.profile.layers[0].param_bytes == prof.layers[0].param_bytes  # bytes untouched
        ratio = cal.profile.layers[3].forward_s / prof.layers[3].forward_s
        assert cal.profile.output.backward_s / prof.output.backward_s == pytest.approx(ratio)
    assert cal.factor > 1 and cal.profile.name == "measured"


def _decide(shape: dict, tp: int, dp: int, pp: int, global_batch: int, failed: set[int]):
    prof = analytic_profile(ModelShape(**shape, tp=tp, sequence_parallel=tp > 1), BF16, h100(tp, dp, pp))
    plan = symmetric_plan(pp, dp, shape["num_layers"], global_batch)
    assert estimate_step(plan, prof).fits_memory
    return Planner(prof, global_batch, 1, PlannerOptions(tp=tp)).decide(plan, failed)


def test_70b_one_failed_node_continues_in_process_and_restarts_only_without_a_live_copy() -> None:
    """TP=8 x PP=8 x DP=2 (128 H100s), global batch 1024: a dead node leaves a replica of every layer,
    so restart (300 s relaunch + half a 30-min checkpoint interval lost) must not win; both replicas of
    stage 1 dead (nodes 2 and 3) leaves layers 10-19 nowhere: only a restart can continue."""
    d = _decide(L70, 8, 2, 8, 1024, {3})
    by = {c.kind: c for c in d.candidates}
    assert d.policy in ("reroute", "reconfigure") and d.policy != "restart"
    assert all(c.feasible for c in d.candidates)
    assert by[d.chosen.kind].score > by["restart"].score
    assert by["reroute"].step_time_s > by["reconfigure"].step_time_s  # Eq. 12: ~2x with DP=2
    lost = _decide(L70, 8, 2, 8, 1024, {2, 3})
    assert lost.policy == "restart"
    assert not any(c.feasible for c in lost.candidates if c.policy != "restart")


def test_7b_one_failed_node_continues_in_process() -> None:
    """The paper's 16-device setting (PP=4, DP=4, TP=1), batch 64."""
    d = _decide(L7, 1, 4, 4, 64, {5})
    assert d.policy != "restart"
    assert math.isfinite(d.chosen.step_time_s)
    assert _decide(L7, 1, 4, 4, 64, {4, 5, 6, 7}).policy == "restart"
