"""A planner profile for the small models ``odyssey train`` runs, before the profiler has measured one.

Bytes are exact (parameter counts of the Llama-2 stage model, fp32 weights, fp32 gradients, Adam's
two fp32 moments); times come from FLOPs at a nominal CPU rate. The planner only needs relative
costs to choose; the overheads are what this machine shows (group rebuild ~0.2 s, state moves over
loopback at ~1 GB/s, a relaunch re-imports megatron-core: ~10 s).
"""
from __future__ import annotations

from dataclasses import replace

from ..planning.profile import LayerCost, ModelProfile
from .config import TrainConfig

CPU_FLOPS = 5e9  # per process, one thread, fp32


def layer_params(cfg: TrainConfig) -> int:
    h, f = cfg.hidden, cfg.ffn
    return 4 * h * h + 3 * h * f + 2 * h  # q, k, v, o; gate, up, down; two RMSNorms


def estimated_profile(cfg: TrainConfig, **overrides: float) -> ModelProfile:
    b, s, h, v = cfg.micro_batch, cfg.seq, cfg.hidden, cfg.vocab
    tp = cfg.tp

    def unit(name: str, params: int, fwd_flops: float, act_bytes: int) -> LayerCost:
        fwd = fwd_flops / (CPU_FLOPS * tp)
        return LayerCost(name, fwd, 2 * fwd, 4 * params // tp, 4 * params // tp, 8 * params // tp, act_bytes // tp,
                         optimizer_s=16 * params / tp / 5e9)

    layer_flops = 2 * b * s * layer_params(cfg) + 4 * b * s * s * h
    layer = unit("layer", layer_params(cfg), layer_flops, 4 * 16 * b * s * h)
    profile = ModelProfile(
        name=f"cpu-llama-L{cfg.layers}-h{h}",
        embedding=unit("embedding", v * h, b * s * h, 4 * b * s * h),
        layers=tuple(replace(layer, name=f"layer{i}") for i in range(cfg.layers)),
        output=unit("output", v * h + h, 2 * b * s * h * v, 4 * b * s * v),
        p2p_s=2e-4, allreduce_bandwidth_Bps=1e9, allreduce_latency_s=1e-4, transfer_bandwidth_Bps=1e9,
        device_memory_bytes=8 * 2**30, reroute_overhead_s=0.2, rebuild_overhead_s=0.5, restart_overhead_s=10.0,
        checkpoint_interval_s=60.0, tp=tp, micro_batch=b, seq_length=s,
    )
    return replace(profile, **overrides) if overrides else profile
