"""``runtime.host_staging``: torch.distributed operations on device tensors through host copies (several ranks
sharing one GPU over gloo). On this CPU machine host tensors are staged too, so every output must have been
copied back for the results to come out right."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron_odyssey.runtime.host_staging import disable_host_staging, enable_host_staging, host_staging_enabled


def test_every_operation_is_staged_and_its_outputs_copied_back() -> None:
    from _runtime_workers import host_staging_worker, on_two_gloo_ranks

    got = on_two_gloo_ranks(host_staging_worker, 120)
    assert got["rebound"] == (True, True)  # names taken before staging was enabled are replaced too
    assert got["all_reduce"] == [3.0] * 3
    assert got["async all_reduce handle"] and got["async all_reduce"] == [3.0] * 3
    assert got["coalesced all_reduce"] == ([3.0] * 2, [30.0] * 4)
    assert got["coalesced async all_gather_into_tensor"] == [1.0, 1.0, 2.0, 2.0]
    assert got["reduce_scatter_tensor into a shard"] == [0.0, 3.0, 2.0, 3.0]  # rank 0's shard: (0, 1) x (1 + 2)
    assert got["broadcast"] == [2.0, 2.0]
    assert got["all_gather"] == [[1.0, 1.0], [2.0, 2.0]]
    assert got["batch_isend_irecv"] == [2.0, 2.0]
    assert got["send, recv, isend, irecv"] == [14.0, 14.0]
    assert got["all_to_all_single"] == [1.0, 2.0]


def test_disabling_puts_every_original_back() -> None:
    before = (dist.all_reduce, dist.isend, dist._coalescing_manager)
    enable_host_staging()
    assert host_staging_enabled() and dist.all_reduce is not before[0]
    assert dist.all_reduce.__odyssey_staged__ is before[0]
    disable_host_staging()
    assert not host_staging_enabled() and (dist.all_reduce, dist.isend, dist._coalescing_manager) == before


def test_a_shared_device_setting_the_adaptor_does_not_know_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_odyssey.megatron_adaptor import SHARED_DEVICE_ENV, _shared_device_if_asked

    monkeypatch.setenv(SHARED_DEVICE_ENV, "yes")
    with pytest.raises(ValueError, match="ODYSSEY_SHARED_DEVICE='yes': expected 1"):
        _shared_device_if_asked()
    assert not host_staging_enabled()


def test_a_rank_waiting_on_its_own_device_in_a_staged_message_is_working_not_communicating(gloo_world) -> None:
    """A staged message copies off the device before it goes and onto it when it arrives, and each copy waits for
    the rank's own kernels. A rank whose device hangs (nvidia-resiliency-ext's GPU_SLEEP) blocks there: it must show
    as working (stuck itself, the one the agent fences), not as communicating (waiting on a peer, which would make
    the agent blame the peers that wait for its message and entered their waits earlier)."""
    import torch

    from megatron_odyssey.runtime import liveness

    seen: list[tuple[str, str]] = []

    class Recorded(torch.Tensor):
        """A tensor that notes the rank's state whenever it is copied off or onto (the copies that wait on the
        device)."""

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in ("to", "copy_"):
                seen.append((name, progress.state))
            out = super().__torch_function__(func, types, args, kwargs or {})
            return out.as_subclass(torch.Tensor) if name == "to" else out

    progress = liveness.Progress()
    liveness.track(progress)
    enable_host_staging(stage_host_tensors=True)
    try:
        progress.mark(0, "forward")
        tensor = torch.ones(3).as_subclass(Recorded)
        with liveness.communicating():
            assert progress.state == liveness.COMM
            dist.all_reduce(tensor)
            assert progress.state == liveness.COMM  # back to waiting on peers after each copy
        assert progress.state == liveness.WORKING
    finally:
        disable_host_staging()
        liveness.track(None)
    assert seen == [("to", liveness.WORKING), ("copy_", liveness.WORKING)]
    assert tensor.as_subclass(torch.Tensor).tolist() == [1.0, 1.0, 1.0]
