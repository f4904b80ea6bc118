"""The planner's profile of a job, from the device it runs on: the model's real shape and precision
(``planning.analytic``), the device's measured matmul rate and memory, and link bandwidths from
``--odyssey-*-bandwidth`` flags or the device kind's defaults (``planning.devices``).

Rank 0 of a Megatron job measures its device (:func:`measure_device`: total memory, a short matmul
benchmark in the job's dtype) and publishes it in the job config (``extra["device"]``); the agent
and every rank then build the same profile with :func:`job_profile`. On CPU (our test lab) the CPU
constants stand in for a measurement. ``--odyssey-profile-iters`` later rescales the compute times to
Megatron's measured forward-backward (:func:`calibrated_profile`).
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from ..planning.analytic import PRECISIONS, ModelShape, analytic_profile
from ..planning.calibration import Calibration, calibrate
from ..planning.devices import Layout, device_params
from ..planning.estimator import estimate_step
from ..planning.plan import ExecutionPlan
from ..planning.profile import ModelProfile
from .config import TrainConfig

BENCH_SIZE = 4096  # square matmul: ~137 GFLOP, a fraction of a millisecond on a current GPU
BENCH_ITERS = 10


def measure_device(device: Any, dtype: Any, size: int = BENCH_SIZE, iters: int = BENCH_ITERS) -> dict[str, Any]:
    """Kind, name, total memory and dense matmul rate (FLOP/s in ``dtype``) of an accelerator; on CPU
    only the kind (the CPU constants are the lab's rates)."""
    import torch

    kind = torch.device(device).type
    if kind == "cpu":
        return {"kind": "cpu"}
    mod = getattr(torch, kind)
    props = mod.get_device_properties(device)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(2):  # kernel selection, clocks
        a @ b
    mod.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    mod.synchronize(device)
    elapsed = time.perf_counter() - start
    del a, b
    return {"kind": kind, "name": getattr(props, "name", kind), "memory_bytes": int(props.total_memory),
            "flops": 2 * size**3 * iters / elapsed}


def model_shape(cfg: TrainConfig) -> ModelShape:
    """The model as the formulas see it; ``extra["model"]`` (a Megatron job) adds what TrainConfig lacks."""
    m = cfg.extra.get("model", {})
    return ModelShape(num_layers=cfg.layers, hidden=cfg.hidden, ffn_hidden=cfg.ffn, heads=cfg.heads,
                      query_groups=m.get("query_groups") or cfg.heads, vocab=cfg.vocab, seq_length=cfg.seq,
                      micro_batch=cfg.micro_batch, tp=cfg.tp, swiglu=m.get("swiglu", True),
                      sequence_parallel=m.get("sequence_parallel", False),
                      flash_attention=m.get("flash_attention", True),
                      attention_dropout=m.get("attention_dropout", False),
                      hidden_dropout=m.get("hidden_dropout", False), bias=m.get("bias", False),
                      layernorm=m.get("layernorm", False))


def symmetric(cfg: TrainConfig) -> ExecutionPlan:
    return cfg.launch_plan()


#: keepers of each shard of the optimizer state once Megatron's distributed optimizer is rebuilt after a failure
REPLICA_COPIES = 2


def job_profile(cfg: TrainConfig, **overrides: Any) -> ModelProfile:
    """The analytic profile of ``cfg`` on its device (see module docstring); ``overrides`` replace fields."""
    dev = cfg.extra.get("device", {})
    links = cfg.extra.get("links", {})
    kind = dev.get("kind", "cpu")
    layout = Layout(tp=cfg.tp, dp=cfg.dp, pp=cfg.pp, ranks_per_node=int(cfg.extra.get("ranks_per_node") or 8))
    device = device_params(kind, layout, name=dev.get("name"), flops=dev.get("flops"),
                           memory_bytes=dev.get("memory_bytes"), p2p_GBps=links.get("p2p"),
                           allreduce_GBps=links.get("allreduce"), transfer_GBps=links.get("transfer"))
    precision = PRECISIONS[cfg.extra.get("precision", "fp32")]
    profile = analytic_profile(model_shape(cfg), precision, device,
                               name=f"{kind}-{precision.name}-L{cfg.layers}-h{cfg.hidden}-tp{cfg.tp}")
    profile = with_checkpoint_interval(profile, cfg)
    if cfg.extra.get("replica_optimizer"):  # sharded after a failure too: megatron_lm.replica_optimizer
        profile = replace(profile, optimizer_shard_copies=REPLICA_COPIES,
                          tied_embeddings=bool(cfg.extra.get("tied_embeddings", False)))
    return replace(profile, **overrides) if overrides else profile


def with_checkpoint_interval(profile: ModelProfile, cfg: TrainConfig, step_s: float | None = None) -> ModelProfile:
    """A job that saves every N iterations loses N/2 steps on a restart (Eq. 8's restart cost): the
    interval in seconds is N x the step time (estimated, or measured when given)."""
    every = cfg.extra.get("save_interval")
    if not every:
        return profile
    if step_s is None:
        step_s = estimate_step(symmetric(cfg), profile).step_time_s
    return replace(profile, checkpoint_interval_s=float(every) * step_s)


def calibrated_profile(cfg: TrainConfig, measured_s: float, base: ModelProfile | None = None) -> Calibration:
    """``base`` (default: the analytic profile) rescaled so the generation-0 (symmetric) plan's estimated
    forward-backward plus gradient sync equals Megatron's measured ``odyssey-forward-backward`` time."""
    plan = symmetric(cfg)
    cal = calibrate(base or job_profile(cfg), plan, measured_s, includes_sync=True, name="measured")
    step = estimate_step(plan, cal.profile).step_time_s
    return replace(cal, profile=with_checkpoint_interval(cal.profile, cfg, step))


def megatron_job_fields(args: Any) -> dict[str, Any]:
    """What ``job_profile`` needs from Megatron's arguments beyond TrainConfig (``extra`` entries)."""
    import os

    from ..megatron_lm.replica_optimizer import supported as replica_supported

    backend = str(getattr(args, "attention_backend", "auto")).rsplit(".", 1)[-1]
    local = getattr(args, "transformer_impl", "transformer_engine") == "local"
    flash = bool(getattr(args, "use_flash_attn", False)) or (not local and backend not in ("unfused", "local"))
    gqa = getattr(args, "group_query_attention", False)
    model = {"query_groups": getattr(args, "num_query_groups", None) if gqa else None,
             "swiglu": bool(getattr(args, "swiglu", False)),
             "sequence_parallel": bool(getattr(args, "sequence_parallel", False)),
             "flash_attention": flash,
             "attention_dropout": bool(getattr(args, "attention_dropout", 0.0)),
             "hidden_dropout": bool(getattr(args, "hidden_dropout", 0.0)),
             "bias": bool(getattr(args, "add_bias_linear", False)),
             "layernorm": getattr(args, "normalization", "LayerNorm") == "LayerNorm"}
    return {"model": model, "precision": "bf16" if getattr(args, "bf16", False) else "fp32",
            "links": {"p2p": getattr(args, "odyssey_p2p_bandwidth", None),
                      "allreduce": getattr(args, "odyssey_allreduce_bandwidth", None),
                      "transfer": getattr(args, "odyssey_transfer_bandwidth", None)},
            "ranks_per_node": int(os.environ.get("LOCAL_WORLD_SIZE") or 0) or None,
            "save_interval": getattr(args, "save_interval", None) if getattr(args, "save", None) else None,
            # generation 0's distributed optimizer: each shard on this many ranks (megatron_lm.distributed_optimizer)
            "distopt_instances": (int(getattr(args, "num_distributed_optimizer_instances", 1))
                                  if getattr(args, "use_distributed_optimizer", False) else None),
            # ... and after a failure, replicated shards (megatron-core 0.15+: megatron_lm.replica_optimizer)
            "replica_optimizer": bool(getattr(args, "use_distributed_optimizer", False)) and replica_supported()}
