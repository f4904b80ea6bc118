"""Megatron-LM's own fault injector's two device faults, which a CPU cannot take, on the GPU: GPU_ERROR (a
device-side assert in the rank's CUDA context: every later CUDA call of that process fails) and GPU_SLEEP (a kernel
that never ends on the rank's default stream: the process and its heartbeat live on, its device is stuck).

Needs a Megatron-LM checkout of core_r0.18.0 or later (where ``megatron.core.fault_injector`` is) as
``MEGATRON_LM_PATH`` or in ``MEGATRON_LM_CHECKOUTS``, and nvidia-resiliency-ext 0.6+ (scripts/device_checks.sh: how
to carry both). Four ranks share the one GPU (``ODYSSEY_SHARED_DEVICE=1``, gloo, host-staged messages); the fault
hits rank 1 as soon as iteration 2 has ended. Every iteration logged equals stock Megatron-LM's on the same device.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


def _injector_checkout() -> str | None:
    """The first checkout given that has Megatron's fault injector (core_r0.18.0 on)."""
    given = [os.environ.get("MEGATRON_LM_PATH", ""), *os.environ.get("MEGATRON_LM_CHECKOUTS", "").split(os.pathsep)]
    return next((c for c in given if c and (Path(c) / "megatron" / "core" / "fault_injector.py").exists()
                 and (Path(c) / "pretrain_gpt.py").exists()), None)


MLM = _injector_checkout()
ITERS = 6

#: fault -> (port, how the agent may tell of rank 1's end)
GPU_FAULTS = {
    # the assert reaches the main thread at its next CUDA call: an exception there ends the rank (its own error
    # record where Odyssey guards the call), or the CUDA runtime aborts the process
    "gpu_error": (29910, ("exited with code 1", "was killed by SIGABRT", "error: ")),
    # the main thread blocks at the first thing that waits on the device while its heartbeat goes on: Megatron's
    # training_log reading the losses (a stop between iterations, where the others wait for it further on), or a
    # host-staged message's copy inside the next iteration (its own device's work: liveness.on_own_device); fenced
    # by progress at --odyssey-hard-timeout either way
    "gpu_sleep": (29940, ("was fenced (SIGKILL): made no progress", "was fenced (SIGKILL): stopped for")),
}


@pytest.mark.skipif(MLM is None, reason="set MEGATRON_LM_PATH or MEGATRON_LM_CHECKOUTS to a Megatron-LM checkout of "
                                        "core_r0.18.0 or later")
@pytest.mark.parametrize("fault", list(GPU_FAULTS))
def test_megatron_device_faults_are_recovered_from_on_the_gpu(tmp_path: Path, fault: str) -> None:
    """Megatron's injector, as it is, puts the fault on rank 1 after iteration 2; exactly that rank leaves, the
    terminal says why (the CUDA error; or the rank named as stopped in its own work), and the survivors (reroute)
    train on equal to stock."""
    pytest.importorskip("nvidia_resiliency_ext.shared_utils.inject_fault",
                        reason="Megatron's fault injector needs nvidia-resiliency-ext 0.6+")
    from megatron_odyssey.testing.megatron_lm_job import (gpu_gpt_flags, run_odyssey, run_stock,
                                                          same_training_where_logged, shared_device_flags)

    port, told = GPU_FAULTS[fault]
    flags = shared_device_flags(gpu_gpt_flags(ITERS, layers=4, hidden=256, heads=8, seq=256, micro_batch=1,
                                              global_batch=8, pipeline_parallel=2))
    stock = run_stock(MLM, tmp_path / "stock", flags, port, nproc=4, gpu=True, shared="1")
    assert stock.returncode == 0, stock.tail()
    job = run_odyssey(MLM, tmp_path / "odyssey", [
        *flags, "--odyssey-heartbeat-timeout", "10", "--odyssey-soft-timeout", "10", "--odyssey-hard-timeout", "20",
        "--odyssey-policy", "reroute", "--fault-injector-ranks", "1", "--fault-injector-fault-types", fault,
        "--fault-injector-fault-delay", "0", "--fault-injector-delay-start-iteration", "2"],
        port + 10, nproc=4, gpu=True, shared="1")
    assert job.returncode == 0, job.tail()
    assert f"FAULT INJECTION: Rank 1 will inject fault {fault.upper()}" in job.logs
    (failure,) = job.report["failures"]
    assert failure["ranks"] == [1] and failure["step"] >= 2, failure
    ended = f"error: {failure['error']['type']}" if failure["error"] else failure["ended"].get("1", "")
    assert ended.startswith(told), (ended, failure)
    console = (tmp_path / "odyssey" / "console0.txt").read_text(errors="replace")  # the terminal, not a rank log
    if fault == "gpu_error":
        assert "device-side assert triggered" in console, console[-4000:]
    else:
        assert ("rank 1 has made no progress" in console or "rank 1 has stopped for" in console) \
            and "fenced after --hard-timeout 20 s" in console, console[-4000:]
        assert 20.0 <= failure["detection_s"] < 60.0, failure
    assert all(d.startswith("cuda") and "gloo" in d for d in job.report["devices"].values()), job.report["devices"]
    assert same_training_where_logged(job, stock.iterations(), rel=1e-5), (job.iterations(), stock.iterations())
