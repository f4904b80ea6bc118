"""Accelerator selection and the CPU-mode patch table, against real megatron-core."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megatron_odyssey.runtime import accelerator as acc


def test_backend_for_each_device_type() -> None:
    assert acc.dist_backend("cuda") == "nccl"
    assert acc.dist_backend("npu") == "hccl"
    assert acc.dist_backend("cpu") == "gloo"
    cpu = acc.Accelerator("cpu", "gloo")
    assert cpu.device() == torch.device("cpu") and cpu.device_count() == 1 and cpu.is_available()
    cpu.synchronize()  # no-op, must not touch CUDA
    with pytest.raises(ValueError):
        acc.Accelerator("tpu", "xla")


def test_the_survivors_world_keeps_the_launch_worlds_gloo(gloo_world: None) -> None:
    """Ranks sharing one GPU run over gloo with their CUDA tensors staged through the host: the worlds built after a
    failure must be gloo's too. Seen on the device (2026-11-26, H100 then H200) when the Megatron-LM host took the
    device's backend instead: the survivors' world was NCCL's, a staged host tensor had no backend ("No backend
    type associated with device type cpu"), and a recovering rank left its gloo connections open, so its peers hung
    in a reduce-scatter until fenced. The launch world's backend is read as the host reads it, from a real gloo
    world (the tests' shared one)."""
    import torch.distributed as dist

    launch = dist.get_backend()
    assert launch == "gloo"  # what MegatronRank compares (shared: Megatron's world is gloo's)
    assert acc.rank_backend(shared=True, device_type="cuda") == "gloo"
    assert acc.rank_backend(shared=False, device_type="cuda") == "nccl"
    assert acc.rank_backend(shared=False, device_type="npu") == "hccl"  # whatever Megatron's flag says on Ascend
    assert acc.rank_backend(shared=False, device_type="cpu") == "gloo"


def test_env_var_forces_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(acc.DEVICE_ENV_VAR, "cpu")
    assert acc.detect_device_type() == "cpu"
    monkeypatch.setenv(acc.DEVICE_ENV_VAR, "quantum")
    with pytest.raises(ValueError):
        acc.detect_device_type()


def test_torch_npu_is_imported_only_when_asked() -> None:
    """Auto-detection and the CPU/CUDA paths never import torch_npu; asking for npu does."""
    code = (
        "import sys\n"
        "from megatron_odyssey.runtime import accelerator as a\n"
        "a.get_accelerator(); a.get_accelerator('cpu'); a.dist_backend('npu')\n"
        "assert 'torch_npu' not in sys.modules\n"
        "try:\n"
        "    a.get_accelerator('npu')\n"
        "except ImportError as e:\n"
        "    assert 'torch_npu' in str(e); print('npu-missing')\n"
        "else:\n"
        "    assert 'torch_npu' in sys.modules; print('npu-present')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in {"npu-missing", "npu-present"}


def test_patch_table_is_explicit_and_resolvable() -> None:
    targets = [p.target for p in acc.CPU_MODE_PATCHES]
    assert len(targets) == len(set(targets))
    for patch in acc.CPU_MODE_PATCHES:
        assert patch.target.startswith("megatron.core.") and patch.why.strip()
        owner, attr = acc._resolve(patch.target)
        assert hasattr(owner, attr), patch.target


def test_enable_is_idempotent_and_disable_restores(gloo_world: None) -> None:
    """Toggle inside the session's CPU mode: originals come back exactly, and the mode again."""
    assert acc.cpu_mode_enabled()
    patched = {p.target: getattr(*acc._resolve(p.target)) for p in acc.CPU_MODE_PATCHES}
    acc.enable_cpu_mode()  # second call: nothing changes
    assert all(getattr(*acc._resolve(t)) is v for t, v in patched.items())

    acc.disable_cpu_mode()
    try:
        assert not acc.cpu_mode_enabled()
        import megatron.core.timers as timers
        import megatron.core.tensor_parallel.random as mrandom

        assert timers.torch is torch  # the module sees the real torch again
        assert mrandom.CudaRNGStatesTracker.__name__ == "CudaRNGStatesTracker"
        assert mrandom._set_cuda_rng_state is not acc._cpu_set_rng_state
        acc.disable_cpu_mode()  # no-op when already off
    finally:
        acc.enable_cpu_mode()
    assert all(getattr(*acc._resolve(t)) is v for t, v in patched.items())
    # torch itself was never modified
    assert torch.cuda.synchronize is not acc.CpuCudaView.synchronize


def test_torch_view_maps_cuda_to_cpu_only_inside_megatron(gloo_world: None) -> None:
    view = acc.CpuTorchView()
    assert view.zeros(3, device="cuda").device.type == "cpu"
    assert view.tensor([1, 2], device=torch.device("cuda", 0), pin_memory=True).device.type == "cpu"
    assert view.cuda.current_device() == torch.device("cpu")
    assert view.Tensor is torch.Tensor and view.float32 is torch.float32
    if not torch.cuda.is_available():
        with pytest.raises((AssertionError, RuntimeError)):
            torch.cuda.current_device()  # the real one is untouched


def test_cpu_rng_tracker_forks_the_cpu_generator(gloo_world: None) -> None:
    """The tracker really swaps torch's CPU generator state: reproducible, and isolated from the
    default stream, as megatron's CUDA tracker is on GPUs."""
    from megatron.core import tensor_parallel

    acc.seed_all(123)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    assert type(tracker) is acc.cpu_rng_tracker_class()

    default_before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(5)
    assert torch.equal(torch.get_rng_state(), default_before)  # default stream untouched
    with tracker.fork():
        b = torch.rand(5)
    assert not torch.equal(a, b)  # the forked stream advanced

    acc.seed_all(123)
    with tracker.fork():
        a2 = torch.rand(5)
    assert torch.equal(a, a2)  # reproducible after re-seeding
    with tracker.fork("data-parallel-rng"):
        c = torch.rand(5)
    assert not torch.equal(a, c)  # distinct named streams

    acc.seed_all(123, tp_rank=1)
    with tracker.fork():
        d = torch.rand(5)
    assert not torch.equal(a, d)  # TP ranks draw different tensor-parallel randomness


def test_activation_recompute_reproduces_dropout(gloo_world: None) -> None:
    """megatron's checkpoint() restores the RNG states on recompute (via the patched get/set):
    gradients with recompute equal those without, even with dropout in the forked region."""
    from megatron.core import tensor_parallel

    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def block(inp: torch.Tensor) -> torch.Tensor:
        with tensor_parallel.get_cuda_rng_tracker().fork():
            h = torch.nn.functional.dropout(inp @ w, p=0.5, training=True)
        return torch.nn.functional.dropout(h, p=0.3, training=True).sum(dim=-1)

    acc.seed_all(5)
    block(x.clone().requires_grad_()).sum().backward()
    g_plain = w.grad.clone()
    w.grad = None

    acc.seed_all(5)
    xin = x.clone().requires_grad_()
    tensor_parallel.checkpoint(block, False, xin).sum().backward()
    assert torch.equal(w.grad, g_plain)


def test_timers_run_on_cpu(gloo_world: None) -> None:
    from megatron.core.timers import Timers

    timers = Timers(log_level=2, log_option="minmax")
    timers("step", log_level=0).start(barrier=True)
    timers("step").stop(barrier=True)
    out = timers._get_global_min_max_time(["step"], reset=False, barrier=True, normalizer=1.0)
    assert out["step"][0] >= 0.0
