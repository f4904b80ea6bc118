"""Defaults per device kind for what a job cannot measure cheaply at start: link bandwidths and
latencies inside and between servers, the fraction of the matmul rate a layer achieves, recovery
overheads. Flags (``--odyssey-*-bandwidth``) override the links; the matmul rate and the memory are
measured (``runtime.device_profile``). Each number says what it assumes.
"""
from __future__ import annotations

from dataclasses import dataclass

from .analytic import DeviceParams
from .errors import PlanningError


@dataclass(frozen=True)
class Link:
    bandwidth_Bps: float  # per device, one direction
    latency_s: float


@dataclass(frozen=True)
class DeviceKind:
    intra: Link  # between devices of one server
    inter: Link  # between servers
    flops: float  # fallback dense matmul rate when none was measured
    layer_efficiency: float
    tp_efficiency: float
    memory_bandwidth_Bps: float
    usable_memory_fraction: float  # the rest: runtime context, communicator buffers, allocator slack
    reroute_overhead_s: float
    rebuild_overhead_s: float
    restart_overhead_s: float
    checkpoint_interval_s: float  # when the job's own save interval is unknown


DEVICE_KINDS: dict[str, DeviceKind] = {
    # NVIDIA H100/A100 in 8-GPU HGX servers. intra: NVLink, 150 GB/s per GPU pair (a third of H100
    # NVLink4's 450 GB/s per direction: NCCL p2p/all-reduce reach far less than the line rate for
    # stage-sized messages); inter: one 200 Gb/s HDR InfiniBand NIC per GPU = 25 GB/s (use
    # --odyssey-*-bandwidth 50 for NDR 400 Gb/s). layer_efficiency: measured on one H100 (local spec,
    # bf16, seq 4096): a Llama-2-7B layer reaches 0.25, a 70B layer 0.38 of a large matmul's 790 TFLOP/s.
    # HBM3 3.35 TB/s (H100 SXM); 10 % of memory kept for the CUDA context, NCCL and the allocator.
    "cuda": DeviceKind(intra=Link(150e9, 10e-6), inter=Link(25e9, 20e-6), flops=400e12, layer_efficiency=0.35,
                       tp_efficiency=0.9, memory_bandwidth_Bps=3.35e12, usable_memory_fraction=0.9,
                       reroute_overhead_s=1.0, rebuild_overhead_s=10.0, restart_overhead_s=300.0,
                       checkpoint_interval_s=1800.0),
    # Ascend 910B in 8-NPU servers: HCCS 56 GB/s between two NPUs; 200 Gb/s RoCE per NPU between
    # servers; peak 313 TFLOP/s BF16 as fallback, MFU 0.45 (the built-in profiles' assumption);
    # HBM2e 1.6 TB/s. Overheads: Odyssey reports 8.2-11.2 s recovery on 8 NPUs.
    "npu": DeviceKind(intra=Link(56e9, 10e-6), inter=Link(25e9, 20e-6), flops=313e12, layer_efficiency=0.45,
                      tp_efficiency=0.9, memory_bandwidth_Bps=1.6e12, usable_memory_fraction=0.9,
                      reroute_overhead_s=1.0, rebuild_overhead_s=10.0, restart_overhead_s=300.0,
                      checkpoint_interval_s=1800.0),
    # Our CPU test lab: one thread per process at ~5 GFLOP/s fp32, gloo over loopback ~1 GB/s, group
    # rebuild ~0.2-0.5 s, a relaunch re-imports megatron-core (~10 s), checkpoints every minute.
    "cpu": DeviceKind(intra=Link(1e9, 1e-4), inter=Link(1e9, 1e-4), flops=5e9, layer_efficiency=1.0,
                      tp_efficiency=1.0, memory_bandwidth_Bps=5e9, usable_memory_fraction=1.0,
                      reroute_overhead_s=0.2, rebuild_overhead_s=0.5, restart_overhead_s=10.0,
                      checkpoint_interval_s=60.0),
}
CPU_MEMORY_BYTES = 8 * 2**30  # what a CPU rank may plan with


def device_kind(kind: str) -> DeviceKind:
    """``cuda``/``npu``/``cpu``; other accelerator kinds plan as ``cuda``."""
    return DEVICE_KINDS.get(kind, DEVICE_KINDS["cuda"])


@dataclass(frozen=True)
class Layout:
    """Where a job's ranks sit: Megatron's order (TP fastest, then DP, then PP), ``ranks_per_node`` per server."""

    tp: int
    dp: int
    pp: int
    ranks_per_node: int

    def dp_group_in_server(self) -> bool:
        return self.tp * self.dp <= self.ranks_per_node

    def job_in_server(self) -> bool:
        return self.tp * self.dp * self.pp <= self.ranks_per_node


def device_params(kind: str, layout: Layout, *, name: str | None = None, flops: float | None = None,
                  memory_bytes: int | None = None, p2p_GBps: float | None = None,
                  allreduce_GBps: float | None = None, transfer_GBps: float | None = None,
                  checkpoint_interval_s: float | None = None) -> DeviceParams:
    """The device as the planner sees it: measured values where given, flags for the links, else the
    kind's defaults. Pipeline neighbours and reconfiguration transfers cross servers unless the whole job
    fits in one; a stage's data-parallel all-reduce stays inside a server when its TP x DP ranks do."""
    d = device_kind(kind)
    p2p = d.intra if layout.job_in_server() else d.inter
    ar = d.intra if layout.dp_group_in_server() else d.inter
    mem = CPU_MEMORY_BYTES if memory_bytes is None and kind == "cpu" else memory_bytes
    if mem is None:
        raise PlanningError(f"device kind {kind!r}: the device memory must be measured or given")
    for flag, v in (("--odyssey-p2p-bandwidth", p2p_GBps), ("--odyssey-allreduce-bandwidth", allreduce_GBps),
                    ("--odyssey-transfer-bandwidth", transfer_GBps)):
        if v is not None and not v > 0:
            raise PlanningError(f"{flag} must be > 0 GB/s, got {v}")
    return DeviceParams(
        name=name or kind, flops=flops or d.flops, memory_bytes=int(mem * d.usable_memory_fraction),
        memory_bandwidth_Bps=d.memory_bandwidth_Bps,
        p2p_bandwidth_Bps=p2p_GBps * 1e9 if p2p_GBps else p2p.bandwidth_Bps, p2p_latency_s=p2p.latency_s,
        allreduce_bandwidth_Bps=allreduce_GBps * 1e9 if allreduce_GBps else ar.bandwidth_Bps,
        allreduce_latency_s=ar.latency_s,
        transfer_bandwidth_Bps=transfer_GBps * 1e9 if transfer_GBps else p2p.bandwidth_Bps,
        layer_efficiency=d.layer_efficiency, tp_efficiency=d.tp_efficiency,
        reroute_overhead_s=d.reroute_overhead_s, rebuild_overhead_s=d.rebuild_overhead_s,
        restart_overhead_s=d.restart_overhead_s,
        checkpoint_interval_s=checkpoint_interval_s or d.checkpoint_interval_s,
    )
