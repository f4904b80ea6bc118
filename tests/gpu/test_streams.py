"""Stream order on the GPU, where a CPU cannot look: a collective must read what every stream of its rank has
queued before it, not only its caller's stream.

Each case queues a write behind a long kernel on a side stream, as core_r0.16.0's gradient hooks add into a
bucket on DDP's set-up stream (``training.get_model``'s ``ddp_stream``), then reads from elsewhere at once.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

#: a kernel busy for about a second on an H100 (cycles at ~1.8 GHz): far longer than the host takes to go on
BUSY_CYCLES = 2_000_000_000


def _written_late(stream: "torch.cuda.Stream", value: float) -> torch.Tensor:
    """A device tensor that ``stream`` fills with ``value`` only after a long kernel."""
    out = torch.zeros(4096, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(BUSY_CYCLES)
        out.fill_(value)
    return out


class _BucketGroup:
    """What Odyssey's ``start_grad_sync`` replacement reads of Megatron's ``_ParamAndGradBucketGroup``."""

    class ddp_config:
        overlap_grad_reduce = True
        num_distributed_optimizer_instances = 2

    def __init__(self, communication_stream: "torch.cuda.Stream"):
        self.communication_stream = communication_stream


def test_a_reduction_started_from_the_hooks_stream_reads_the_hooks_last_add() -> None:
    """core_r0.16.0's ``start_grad_sync`` (its stream handling; the reduction here a copy on its communication
    stream) called on the stream its gradient hooks run on: stock reads the bucket before the hook's queued add;
    under --odyssey (``hooks.grad_sync_once``) the communication stream waits for the caller's stream as well."""
    from megatron_odyssey.megatron_lm import hooks

    hook_stream, communication = torch.cuda.Stream(), torch.cuda.Stream()

    def megatron_start_grad_sync(group: _BucketGroup) -> None:
        group.communication_stream.wait_stream(torch.cuda.default_stream())
        with torch.cuda.stream(group.communication_stream):
            group.read = group.bucket.clone()

    def reduce(start_grad_sync) -> float:
        group = _BucketGroup(communication)
        group.bucket = _written_late(hook_stream, 1.0)
        with torch.cuda.stream(hook_stream):
            start_grad_sync(group)
        torch.cuda.synchronize()
        return float(group.read.min())

    assert reduce(megatron_start_grad_sync) == 0.0  # the race core_r0.16.0 has: the add not yet there
    hooks.STATE.runtime = object()  # (the replacement acts only inside an Odyssey rank)
    try:
        assert reduce(hooks.grad_sync_once(megatron_start_grad_sync)) == 1.0
    finally:
        hooks.reset_state()


def test_a_host_staged_collective_reads_what_every_stream_queued_before_it(tmp_path: Path) -> None:
    """``runtime.host_staging``: a gather of a tensor still being written on a side stream, called from the default
    stream, gathers the written value (its host copy waits for the whole device), as the shared-device Megatron-LM
    tests need for a stock reference that does not race with itself."""
    import torch.distributed as dist

    from megatron_odyssey.runtime.host_staging import disable_host_staging, enable_host_staging

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    enable_host_staging()
    try:
        source = _written_late(torch.cuda.Stream(), 1.0)
        gathered = [torch.zeros_like(source)]
        dist.all_gather(gathered, source)
        torch.cuda.synchronize()
        assert float(gathered[0].min()) == 1.0
    finally:
        disable_host_staging()
        dist.destroy_process_group()
