"""GPT-3 Medium on A100s: ReCycle's fidelity setting, a built-in profile beside the Llama-2 ones.

Derived from FLOPs with the same recipe as ``profile.builtin_profile`` (see ``GPT3_ASSUMPTIONS``), so
that every policy the simulator compares, and ``odyssey plan``, get step and transition times from
one estimator. Registered by name in ``planning.models``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .profile import LayerCost, ModelProfile


@dataclass(frozen=True)
class A100Spec:
    """NVIDIA A100 80 GB SXM (spec sheet) in an Azure NC96ads_A100_v4 server (ReCycle's testbed)."""

    name: str = "a100-80gb"
    peak_flops: float = 312e12  # dense BF16
    mfu: float = 0.45  # same achieved fraction as the built-in 910B profile, for comparability
    hbm_bytes: int = 80 * 2**30
    hbm_bandwidth_Bps: float = 2.0e12
    link_bandwidth_Bps: float = 10e9  # 640 Gb/s per 8-GPU server between servers = 10 GB/s per GPU
    link_latency_s: float = 20e-6


@dataclass(frozen=True)
class GPTShape:
    hidden: int
    ffn_hidden: int
    heads: int
    vocab: int
    num_layers: int
    seq_length: int


GPT3_MEDIUM = GPTShape(hidden=1024, ffn_hidden=4096, heads=16, vocab=50257, num_layers=24, seq_length=2048)

GPT3_ASSUMPTIONS = """\
gpt3-medium-a100 (ReCycle's GPT-3 Medium setting), derived from FLOPs, not measured:
- shape: 24 layers, hidden 1024, 16 heads, GeLU MLP 4096, vocab 50257, sequence 2048 (Brown et al. 2020);
- forward FLOPs per layer = 24*b*s*h^2 + 4*b*s^2*h; backward = 2 x forward; output layer 2*b*s*h*V;
- A100 80 GB: 312 TFLOP/s dense BF16 at MFU 0.45 (same MFU as the 910B profile), 2.0 TB/s HBM;
- links: 10 GB/s per GPU between servers (640 Gb/s per 8-GPU Azure NC96ads_A100_v4 server, the
  testbed in ReCycle's slides), 20 us per hop;
- memory per parameter 2+4+12 B (BF16 weight, FP32 grad, FP32 master + Adam), activations 34*s*b*h B
  per layer and micro-batch; overheads as the built-in profile (reroute 1 s, rebuild 10 s, restart 300 s).
"""


def gpt3_medium_profile(num_layers: int | None = None, tp: int = 1, micro_batch: int = 1,
                        seq_length: int | None = None, device: A100Spec = A100Spec()) -> ModelProfile:
    shape = GPT3_MEDIUM
    L = num_layers or shape.num_layers
    h, f, V = shape.hidden, shape.ffn_hidden, shape.vocab
    s, b = seq_length or shape.seq_length, micro_batch
    rate = device.peak_flops * device.mfu * tp * (0.9 if tp > 1 else 1.0)
    layer_params = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
    layer_fwd = 2 * b * s * (4 * h * h + 2 * h * f) + 4 * b * s * s * h

    def unit(name: str, params: int, fwd_flops: float, act_bytes: float, floor_s: float = 0.0) -> LayerCost:
        fwd = max(fwd_flops / rate, floor_s)
        return LayerCost(name=name, forward_s=fwd, backward_s=2 * fwd,
                         param_bytes=int(2 * params / tp), grad_bytes=int(4 * params / tp),
                         optimizer_bytes=int(12 * params / tp), activation_bytes=int(act_bytes / tp),
                         optimizer_s=30 * params / tp / device.hbm_bandwidth_Bps)

    boundary = 2 * s * b * h
    embedding = unit("embedding", V * h + shape.seq_length * h, 0.0, boundary,
                     floor_s=2 * boundary / device.hbm_bandwidth_Bps)
    layer = unit("layer", layer_params, layer_fwd, 34 * s * b * h)
    output = unit("output", V * h + 2 * h, 2 * b * s * h * V, 4 * s * b * V)
    return ModelProfile(
        name=f"gpt3-medium-{device.name}-tp{tp}-mb{micro_batch}-seq{s}",
        embedding=embedding, layers=tuple(replace(layer, name=f"layer{i}") for i in range(L)), output=output,
        p2p_s=boundary / device.link_bandwidth_Bps + device.link_latency_s,
        allreduce_bandwidth_Bps=device.link_bandwidth_Bps, allreduce_latency_s=device.link_latency_s,
        transfer_bandwidth_Bps=device.link_bandwidth_Bps, device_memory_bytes=device.hbm_bytes,
        tp=tp, micro_batch=micro_batch, seq_length=s)
