"""What one layer costs in time and memory, and what the hardware offers: the estimator's inputs.

A profile is per node (one TP group) at a fixed micro-batch size and sequence length. The
embedding and the output layer (final norm + LM head) are entries of their own, because they are
large and sit only on the first and last stage. Profiles come from the runtime profiler (Megatron
timers) or from ``builtin_profile``, which derives them from FLOPs with the assumptions stated in
``BUILTIN_ASSUMPTIONS``.
"""
from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from .errors import PlanningError, read_user_file

PROFILE_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class LayerCost:
    """Cost of one layer for one micro-batch on one node."""

    name: str
    forward_s: float
    backward_s: float
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int  # kept per in-flight micro-batch until its backward
    optimizer_s: float = 0.0
    # the weight-gradient part of backward_s (what a filled reroute defers); None: half of it, the
    # share of a layer made of GEMMs, whose input- and weight-gradient GEMMs cost the same
    weight_grad_s: float | None = None

    @property
    def deferrable_s(self) -> float:
        """Time of the weight-gradient (W) half of backward; the input-gradient (B) half is the rest."""
        return self.backward_s / 2 if self.weight_grad_s is None else self.weight_grad_s

    @property
    def static_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def state_bytes(self) -> int:
        """Bytes that move when a node takes over this layer: weights and optimizer state."""
        return self.param_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class ModelProfile:
    name: str
    embedding: LayerCost
    layers: tuple[LayerCost, ...]
    output: LayerCost
    p2p_s: float  # one activation (or its gradient) between neighbouring stages
    allreduce_bandwidth_Bps: float  # bus bandwidth of a ring all-reduce
    allreduce_latency_s: float  # per ring hop
    transfer_bandwidth_Bps: float  # point-to-point state transfer during reconfiguration
    device_memory_bytes: int
    reroute_overhead_s: float = 1.0  # new groups, no state moves
    rebuild_overhead_s: float = 10.0  # in-process rebuild after reconfiguration
    restart_overhead_s: float = 300.0  # relaunch the job and load a checkpoint
    checkpoint_interval_s: float = 1800.0  # expected lost work on restart = half of this
    tp: int = 1
    micro_batch: int = 1
    seq_length: int = 4096
    # 0: every holder of a unit keeps the unit's whole optimizer state (the plain optimizer); c >= 1: the state is
    # sharded over the unit's holders, each shard kept by c of them (planning.sharding; Megatron's distributed
    # optimizer after a failure keeps 2)
    optimizer_shard_copies: int = 0
    # the output layer's weight is the word embeddings' (Megatron's default for GPT): with a sharded optimizer the
    # shared weight's state is sharded over every holder of either end (planning.sharding.tied_holders)
    tied_embeddings: bool = False
    schema_version: int = PROFILE_SCHEMA_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise PlanningError("profile has no transformer layers")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def units(self) -> list[LayerCost]:
        """Every weight-holding unit in model order: embedding, layers 0..L-1, output."""
        return [self.embedding, *self.layers, self.output]

    # -- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "profile") -> "ModelProfile":
        _check_fields(cls, data, source)
        version = data.get("schema_version", PROFILE_SCHEMA_VERSION)
        if version != PROFILE_SCHEMA_VERSION:
            raise PlanningError(f"{source}: schema_version {version} is not supported "
                                f"(this version reads {PROFILE_SCHEMA_VERSION})")
        kw = dict(data)
        for key in ("embedding", "output"):
            if key not in kw:
                raise PlanningError(f"{source}: missing field {key!r}")
            kw[key] = _layer_from_dict(kw[key], f"{source}.{key}")
        if "layers" not in kw or not isinstance(kw["layers"], (list, tuple)):
            raise PlanningError(f"{source}: field 'layers' must be a list of layer entries")
        kw["layers"] = tuple(_layer_from_dict(x, f"{source}.layers[{i}]") for i, x in enumerate(kw["layers"]))
        missing = [f.name for f in fields(cls) if f.name not in kw and f.default is MISSING]
        if missing:
            raise PlanningError(f"{source}: missing field(s) {missing}")
        if not kw["layers"]:
            raise PlanningError(f"{source}: field 'layers' is empty; a profile needs at least one transformer layer")
        _check_numbers(kw, source, positive=_POSITIVE_FIELDS, non_negative=_NON_NEGATIVE_FIELDS,
                       integers=_INTEGER_FIELDS)
        return cls(**kw)

    @classmethod
    def load(cls, path: str | Path, source: str | None = None) -> "ModelProfile":
        """Read a profile JSON; ``source`` (default: the path) starts every error message."""
        source = source or str(path)
        text = read_user_file(path, source, "a profile JSON file")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanningError(f"{source}: not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise PlanningError(f"{source}: must hold a JSON object (a ModelProfile), not {type(data).__name__}")
        return cls.from_dict(data, source=source)


_POSITIVE_FIELDS = ("allreduce_bandwidth_Bps", "transfer_bandwidth_Bps", "device_memory_bytes", "tp",
                    "micro_batch", "seq_length")
_NON_NEGATIVE_FIELDS = ("p2p_s", "allreduce_latency_s", "reroute_overhead_s", "rebuild_overhead_s",
                        "restart_overhead_s", "checkpoint_interval_s")
_NON_NEGATIVE_FIELDS += ("optimizer_shard_copies",)
_INTEGER_FIELDS = ("device_memory_bytes", "tp", "micro_batch", "seq_length", "optimizer_shard_copies")
_LAYER_NUMBERS = ("forward_s", "backward_s", "param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes",
                  "optimizer_s")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # not NaN


def _check_numbers(data: dict[str, Any], source: str, positive: tuple[str, ...] = (),
                   non_negative: tuple[str, ...] = (), integers: tuple[str, ...] = ()) -> None:
    """Reject a wrong-typed or out-of-range number here, by name, rather than as a TypeError deep in
    the estimator."""
    for name in positive + non_negative:
        if name not in data:
            continue
        value = data[name]
        if not _is_number(value) or value < 0 or (name in positive and value == 0):
            want = "a positive" if name in positive else "a non-negative"
            raise PlanningError(f"{source}: field {name!r} must be {want} number, got {value!r}")
        if name in integers and not isinstance(value, int):
            raise PlanningError(f"{source}: field {name!r} must be an integer, got {value!r}")


def _check_fields(cls: type, data: dict[str, Any], source: str) -> None:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise PlanningError(f"{source}: unknown profile field(s) {unknown}; known fields are {sorted(known)}")


def _layer_from_dict(data: Any, source: str) -> LayerCost:
    if not isinstance(data, dict):
        raise PlanningError(f"{source}: a layer entry must be a JSON object")
    _check_fields(LayerCost, data, source)
    missing = [f.name for f in fields(LayerCost) if f.name not in data and f.default is MISSING]
    if missing:
        raise PlanningError(f"{source}: missing field(s) {missing}")
    _check_numbers(data, source, non_negative=_LAYER_NUMBERS)
    w = data.get("weight_grad_s")
    if w is not None and (not _is_number(w) or not 0 <= w <= data["backward_s"]):
        raise PlanningError(f"{source}: field 'weight_grad_s' must be a number between 0 and backward_s "
                            f"({data['backward_s']!r}), got {w!r}")
    return LayerCost(**data)


# -- built-in profiles derived from FLOPs --------------------------------------------------------

@dataclass(frozen=True)
class TransformerShape:
    hidden: int
    ffn_hidden: int
    heads: int
    kv_heads: int
    vocab: int
    num_layers: int


SHAPES = {
    "llama2-7b": TransformerShape(hidden=4096, ffn_hidden=11008, heads=32, kv_heads=32, vocab=32000, num_layers=32),
    "llama2-70b": TransformerShape(hidden=8192, ffn_hidden=28672, heads=64, kv_heads=8, vocab=32000, num_layers=80),
}


@dataclass(frozen=True)
class DeviceSpec:
    """A 910B-class accelerator; numbers are public spec-sheet values, see BUILTIN_ASSUMPTIONS."""

    name: str = "ascend-910b"
    peak_flops: float = 313e12  # dense BF16
    mfu: float = 0.45  # achieved fraction of peak in large-model training
    hbm_bytes: int = 64 * 2**30
    hbm_bandwidth_Bps: float = 1.6e12
    link_bandwidth_Bps: float = 25e9  # 200 Gb/s RoCE per device between servers
    link_latency_s: float = 20e-6
    tp_efficiency: float = 0.9  # per-device efficiency inside a TP group (intra-server HCCS)


BUILTIN_ASSUMPTIONS = """\
Built-in profiles are derived from FLOPs, not measured (planning.analytic.ANALYTIC_ASSUMPTIONS has the
formulas shared with every estimated profile):
- Llama-2 shapes (SwiGLU, RMSNorm, no biases, GQA for 70B), BF16 mixed precision, flash attention,
  sequence parallelism when TP > 1.
- time = FLOPs / (peak * MFU * TP * tp_efficiency) with peak 313 TFLOP/s BF16 (910B-class), MFU 0.45,
  tp_efficiency 0.9 when TP > 1.
- memory per parameter: 2 B BF16 weight, 4 B FP32 main gradient, 12 B FP32 master weight + Adam m, v
  (Megatron mixed precision, non-distributed optimizer); split over TP (norms replicated).
- links: 25 GB/s per device (200 Gb/s RoCE), 20 us per hop; optimizer step = 30 B touched per
  parameter at 1.6 TB/s HBM; device memory 64 GiB.
- overheads: reroute 1 s (new groups only), in-process rebuild 10 s (Odyssey reports 8.2-11.2 s total
  recovery on 8 NPUs), job restart + checkpoint load 300 s, checkpoint every 30 min.
"""


def builtin_profile(model: str = "llama2-7b", num_layers: int | None = None, tp: int = 1,
                    micro_batch: int = 1, seq_length: int = 4096,
                    device: DeviceSpec = DeviceSpec()) -> ModelProfile:
    """A Llama-2 profile on a 910B-class device (64 GB HBM), derived from FLOPs (see BUILTIN_ASSUMPTIONS)."""
    from .analytic import BF16, DeviceParams, ModelShape, analytic_profile

    if model not in SHAPES:
        raise PlanningError(f"unknown built-in profile {model!r}; choose one of {sorted(SHAPES)} or pass a JSON file")
    shape = SHAPES[model]
    model_shape = ModelShape(
        num_layers=num_layers if num_layers is not None else shape.num_layers, hidden=shape.hidden,
        ffn_hidden=shape.ffn_hidden, heads=shape.heads, query_groups=shape.kv_heads, vocab=shape.vocab,
        seq_length=seq_length, micro_batch=micro_batch, swiglu=True, tp=tp, sequence_parallel=tp > 1)
    params = DeviceParams(
        name=device.name, flops=device.peak_flops, layer_efficiency=device.mfu, tp_efficiency=device.tp_efficiency,
        memory_bytes=device.hbm_bytes, memory_bandwidth_Bps=device.hbm_bandwidth_Bps,
        p2p_bandwidth_Bps=device.link_bandwidth_Bps, p2p_latency_s=device.link_latency_s,
        allreduce_bandwidth_Bps=device.link_bandwidth_Bps, allreduce_latency_s=device.link_latency_s,
        transfer_bandwidth_Bps=device.link_bandwidth_Bps)
    return analytic_profile(model_shape, BF16, params,
                            name=f"{model}-{device.name}-tp{tp}-mb{micro_batch}-seq{seq_length}")


def uniform_profile(num_layers: int, forward_s: float = 1.0, backward_s: float = 2.0,
                    layer_bytes: int = 1, activation_bytes: int = 0, device_memory_bytes: int = 2**62,
                    p2p_s: float = 0.0, allreduce_bandwidth_Bps: float = float("inf"),
                    allreduce_latency_s: float = 0.0, **overheads: float) -> ModelProfile:
    """Identical layers and free embedding/output: the setting of the paper's closed forms (Eq. 9, 12, 13)."""
    layer = LayerCost("layer", forward_s, backward_s, layer_bytes, layer_bytes, 2 * layer_bytes, activation_bytes)
    free = LayerCost("free", 0.0, 0.0, 0, 0, 0, 0)
    return ModelProfile(
        name=f"uniform-{num_layers}", embedding=replace(free, name="embedding"),
        layers=tuple(replace(layer, name=f"layer{i}") for i in range(num_layers)),
        output=replace(free, name="output"), p2p_s=p2p_s,
        allreduce_bandwidth_Bps=allreduce_bandwidth_Bps, allreduce_latency_s=allreduce_latency_s,
        transfer_bandwidth_Bps=1e9, device_memory_bytes=device_memory_bytes, **overheads,
    )
