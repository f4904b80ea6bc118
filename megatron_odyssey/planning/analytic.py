"""An analytic profile from a transformer's shape, its precision and the device: the one FLOP, byte and
activation formula every estimated profile uses (built-in Llama-2 profiles, ``odyssey train`` on CPU,
Megatron-LM jobs on GPUs/NPUs), so the planner sees the same model whichever way a job starts.

Pure Python (the planning layer never imports torch); the runtime supplies the device's measured
matmul rate and memory (``runtime.device_profile``). The assumptions are spelled out in
``ANALYTIC_ASSUMPTIONS`` and next to each default.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .errors import PlanningError
from .profile import LayerCost, ModelProfile

ANALYTIC_ASSUMPTIONS = """\
Analytic profile (per device of a TP group, one micro-batch of b sequences of s tokens):
- forward FLOPs per layer = 2*b*s*(h*(h + 2*h_kv) + h*h) + 4*b*s^2*h + (6 SwiGLU | 4 GeLU)*b*s*h*f
  (QKV with h_kv = h * query_groups / heads, attention scores and values, projection, MLP);
  output layer 2*b*s*h*V; backward = 2 x forward; the embedding is a memory-bound lookup.
- time = FLOPs / (device matmul rate * layer efficiency * TP * TP efficiency (TP > 1)); the rate is
  measured at job start on GPUs/NPUs, 5 GFLOP/s on CPU; --odyssey-profile-iters rescales the result
  so the estimated step equals Megatron's measured one.
- bytes per parameter: bf16 = 2 weight + 4 fp32 main grad + 12 fp32 main weight and Adam m, v
  (Megatron mixed precision, non-distributed optimizer); fp32 = 4 + 4 + 8. Matrices and their
  biases are split over TP, norms and row-parallel biases are replicated.
- activations per layer (elements, at the activation dtype): 4*s*b*h norm inputs/outputs (split over
  TP only with sequence parallelism) + s*b*(2*h + 2*h_kv + 3*f SwiGLU | 2*f GeLU) (q, k, v, context,
  MLP) / TP, + a*s^2*b softmax probabilities / TP without flash attention; dropout masks 1 byte.
  Output layer keeps fp32 logits (4*s*b*V/TP bytes).
- optimizer step time = bytes touched per parameter (bf16 30, fp32 28) / memory bandwidth.
- stage-boundary activation = s*b*h elements (/ TP with sequence parallelism), sent at the p2p rate.
"""


@dataclass(frozen=True)
class ModelShape:
    """What the formulas need to know about a dense GPT/Llama model and how one stage runs it."""

    num_layers: int
    hidden: int
    ffn_hidden: int
    heads: int
    query_groups: int  # = heads without GQA
    vocab: int
    seq_length: int
    micro_batch: int
    swiglu: bool = True
    tp: int = 1
    sequence_parallel: bool = False
    flash_attention: bool = True  # False: the softmax probabilities (a*s^2*b) are kept for backward
    attention_dropout: bool = False  # a 1-byte mask per attention probability (unfused attention only)
    hidden_dropout: bool = False  # two 1-byte masks of s*b*h per layer
    bias: bool = False  # linear layers carry biases (Megatron's default; Llama has none)
    layernorm: bool = False  # LayerNorm (weight + bias) instead of RMSNorm (weight)

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden", "ffn_hidden", "heads", "query_groups", "vocab", "seq_length",
                     "micro_batch", "tp"):
            if getattr(self, name) < 1:
                raise PlanningError(f"model shape: {name} must be >= 1, got {getattr(self, name)}")
        if self.heads % self.query_groups:
            raise PlanningError(f"model shape: {self.heads} heads are not divisible into {self.query_groups} query groups")

    @property
    def kv_hidden(self) -> int:
        return self.hidden * self.query_groups // self.heads


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each kind of state, and per activation element."""

    name: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    optimizer_touched_bytes: int  # read + written per parameter by one Adam step


BF16 = Precision("bf16", param_bytes=2, grad_bytes=4, optimizer_bytes=12, activation_bytes=2,
                 optimizer_touched_bytes=30)  # grad 4 + main 4+4 + m, v 8+8 + bf16 copy 2
FP32 = Precision("fp32", param_bytes=4, grad_bytes=4, optimizer_bytes=8, activation_bytes=4,
                 optimizer_touched_bytes=28)  # grad 4 + param 4+4 + m, v 8+8
PRECISIONS = {p.name: p for p in (BF16, FP32)}


@dataclass(frozen=True)
class DeviceParams:
    """One device and its links as the planner sees it: rates, memory, bandwidths, overheads."""

    name: str
    flops: float  # dense matmul rate in the job's dtype (measured, or a spec value)
    memory_bytes: int  # what the planner may fill (see usable_memory_fraction in device_params)
    memory_bandwidth_Bps: float
    p2p_bandwidth_Bps: float
    p2p_latency_s: float
    allreduce_bandwidth_Bps: float  # ring all-reduce bus bandwidth per device
    allreduce_latency_s: float
    transfer_bandwidth_Bps: float  # per-device state transfer during reconfiguration
    layer_efficiency: float = 1.0  # fraction of ``flops`` a transformer layer's forward+backward achieves
    tp_efficiency: float = 1.0  # per-device efficiency inside a TP group (its communication), TP > 1
    reroute_overhead_s: float = 1.0
    rebuild_overhead_s: float = 10.0
    restart_overhead_s: float = 300.0
    checkpoint_interval_s: float = 1800.0

    def __post_init__(self) -> None:
        for name in ("flops", "memory_bytes", "memory_bandwidth_Bps", "p2p_bandwidth_Bps",
                     "allreduce_bandwidth_Bps", "transfer_bandwidth_Bps", "layer_efficiency", "tp_efficiency"):
            if not getattr(self, name) > 0:
                raise PlanningError(f"device {self.name}: {name} must be > 0, got {getattr(self, name)}")


# -- counts ---------------------------------------------------------------------------------------

def layer_forward_flops(shape: ModelShape) -> float:
    """Forward FLOPs of one transformer layer for one micro-batch (whole layer, before TP)."""
    b, s, h, f = shape.micro_batch, shape.seq_length, shape.hidden, shape.ffn_hidden
    mlp = (6 if shape.swiglu else 4) * b * s * h * f
    return 2 * b * s * (h * (h + 2 * shape.kv_hidden) + h * h) + 4 * b * s * s * h + mlp


def output_forward_flops(shape: ModelShape) -> float:
    return 2 * shape.micro_batch * shape.seq_length * shape.hidden * shape.vocab


def layer_params(shape: ModelShape) -> tuple[int, int]:
    """(parameters split over TP, parameters replicated on every TP rank) of one layer."""
    h, f, kv = shape.hidden, shape.ffn_hidden, shape.kv_hidden
    fc1 = 2 * f if shape.swiglu else f
    split = h * (h + 2 * kv) + h * h + h * fc1 + f * h
    norms = 2 * (2 * h if shape.layernorm else h)
    replicated = norms
    if shape.bias:
        split += (h + 2 * kv) + fc1  # column-parallel biases
        replicated += 2 * h  # row-parallel biases (projection, fc2)
    return split, replicated


def device_params_count(split: int, replicated: int, tp: int) -> int:
    return -(-split // tp) + replicated


def layer_activation_bytes(shape: ModelShape, precision: Precision) -> int:
    """Bytes one layer keeps per micro-batch until its backward, on one TP rank (see ANALYTIC_ASSUMPTIONS)."""
    b, s, h, f, a, tp = shape.micro_batch, shape.seq_length, shape.hidden, shape.ffn_hidden, shape.heads, shape.tp
    e = precision.activation_bytes
    along_seq = tp if shape.sequence_parallel else 1
    replicated = 4 * s * b * h * e + (2 * s * b * h if shape.hidden_dropout else 0)
    split = s * b * (2 * h + 2 * shape.kv_hidden + (3 if shape.swiglu else 2) * f) * e
    if not shape.flash_attention:
        split += a * s * s * b * (e + (1 if shape.attention_dropout else 0))
    return replicated // along_seq + split // tp


def boundary_bytes(shape: ModelShape, precision: Precision) -> int:
    """One activation between neighbouring stages, per TP rank."""
    along_seq = shape.tp if shape.sequence_parallel else 1
    return shape.seq_length * shape.micro_batch * shape.hidden * precision.activation_bytes // along_seq


# -- the profile ----------------------------------------------------------------------------------

def analytic_profile(shape: ModelShape, precision: Precision, device: DeviceParams, name: str | None = None) -> ModelProfile:
    """Per-unit costs of ``shape`` on ``device`` at ``precision`` (see ANALYTIC_ASSUMPTIONS)."""
    tp, h, v = shape.tp, shape.hidden, shape.vocab
    rate = device.flops * device.layer_efficiency * tp * (device.tp_efficiency if tp > 1 else 1.0)
    boundary = boundary_bytes(shape, precision)

    def unit(unit_name: str, params: int, fwd_s: float, act_bytes: int) -> LayerCost:
        return LayerCost(
            name=unit_name, forward_s=fwd_s, backward_s=2 * fwd_s,
            param_bytes=params * precision.param_bytes, grad_bytes=params * precision.grad_bytes,
            optimizer_bytes=params * precision.optimizer_bytes, activation_bytes=act_bytes,
            optimizer_s=params * precision.optimizer_touched_bytes / device.memory_bandwidth_Bps)

    split, replicated = layer_params(shape)
    layer = unit("layer", device_params_count(split, replicated, tp), layer_forward_flops(shape) / rate,
                 layer_activation_bytes(shape, precision))
    norm = 2 * h if shape.layernorm else h
    # the lookup reads and writes s*b*h activations: memory-bound, not split over TP
    lookup_s = 2 * shape.seq_length * shape.micro_batch * h * precision.activation_bytes / device.memory_bandwidth_Bps
    embedding = unit("embedding", device_params_count(v * h, 0, tp), lookup_s, boundary)
    output = unit("output", device_params_count(v * h, norm, tp), output_forward_flops(shape) / rate,
                  4 * shape.seq_length * shape.micro_batch * v // tp)
    return ModelProfile(
        name=name or f"analytic-{device.name}-{precision.name}-L{shape.num_layers}-h{h}-tp{tp}-mb{shape.micro_batch}",
        embedding=embedding,
        layers=tuple(replace(layer, name=f"layer{i}") for i in range(shape.num_layers)),
        output=output,
        p2p_s=boundary / device.p2p_bandwidth_Bps + device.p2p_latency_s,
        allreduce_bandwidth_Bps=device.allreduce_bandwidth_Bps,
        allreduce_latency_s=device.allreduce_latency_s,
        transfer_bandwidth_Bps=device.transfer_bandwidth_Bps,
        device_memory_bytes=int(device.memory_bytes),
        reroute_overhead_s=device.reroute_overhead_s,
        rebuild_overhead_s=device.rebuild_overhead_s,
        restart_overhead_s=device.restart_overhead_s,
        checkpoint_interval_s=device.checkpoint_interval_s,
        tp=tp, micro_batch=shape.micro_batch, seq_length=shape.seq_length,
    )
