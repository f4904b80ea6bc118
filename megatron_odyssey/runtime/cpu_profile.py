"""A planner profile for the small models ``odyssey train`` runs on CPU, before the profiler has measured one.

Kept as the CPU entry point; the formulas are ``planning.analytic``'s (shared with GPU jobs), the CPU
constants ``planning.devices.DEVICE_KINDS["cpu"]``: FLOPs at a nominal 5 GFLOP/s per process, fp32
bytes (weights, gradients, Adam's two moments), state moves over loopback at ~1 GB/s, group rebuild
~0.5 s, a relaunch re-imports megatron-core (~10 s). The planner only needs relative costs to choose.
"""
from __future__ import annotations

from typing import Any

from ..planning.analytic import layer_params as _layer_params
from ..planning.devices import DEVICE_KINDS
from ..planning.profile import ModelProfile
from .config import TrainConfig
from .device_profile import job_profile, model_shape

CPU_FLOPS = DEVICE_KINDS["cpu"].flops  # per process, one thread, fp32


def layer_params(cfg: TrainConfig) -> int:
    """Parameters of one (unsplit) layer of ``cfg``'s model."""
    split, replicated = _layer_params(model_shape(cfg))
    return split + replicated


def estimated_profile(cfg: TrainConfig, **overrides: Any) -> ModelProfile:
    """``cfg``'s analytic profile on its device (CPU unless the job config names another)."""
    return job_profile(cfg, **overrides)
