"""Both entry points on a real GPU: ``odyssey train`` (one rank; four ranks sharing the device through
a kill and a reconfiguration) and Megatron-LM's ``pretrain_gpt.py --odyssey`` against stock Megatron-LM (one rank;
four or eight sharing the device through a kill, over gloo with host-staged messages).

Exactness is against fault-free runs on the same device (fp32 for ``odyssey train``: <= 1e-5), never
against the CPU, whose kernels sum differently.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import pytest
import torch

from megatron_odyssey.runtime.config import TrainConfig
from megatron_odyssey.standalone.launcher import launch

pytestmark = pytest.mark.gpu

TOL = 1e-5
MODEL = dict(layers=4, hidden=64, heads=4, seq=32, global_batch=8, micro_batch=1, steps=4, seed=7)


@pytest.fixture
def reference(fault_free_reference: Callable) -> dict:
    """The fault-free one-process run on the GPU, run once for every test here (tests/conftest.py)."""
    ref = fault_free_reference(TrainConfig(nproc=1, tp=1, pp=1, **MODEL))
    assert ref["device"].startswith("cuda")
    return ref


def train(tmp_path: Path, **kw) -> tuple[dict, dict]:
    cfg = TrainConfig(save_params=str(tmp_path / "p.pt"), report=str(tmp_path / "report.json"), **{**MODEL, **kw})
    launch(cfg, tmp_path / "run")
    return torch.load(tmp_path / "p.pt"), json.loads((tmp_path / "report.json").read_text())


def worst(params: dict, reference: dict) -> float:
    assert set(params) == set(reference["params"])
    return max((params[k] - reference["params"][k]).abs().max().item() for k in params)


def test_odyssey_train_one_rank_on_the_gpu(reference: dict, tmp_path: Path) -> None:
    params, report = train(tmp_path, nproc=1, pp=1)
    assert report["ok"] and report["devices"]["0"].startswith("cuda") and "nccl" in report["devices"]["0"]
    assert worst(params, reference) <= TOL
    assert [s["loss"] for s in report["steps"]] == pytest.approx(reference["losses"], abs=TOL)


@pytest.mark.parametrize("policy,fail", [("reconfigure", "step=1,rank=3,phase=backward,kind=kill"),
                                         ("reroute", "step=2,rank=1,phase=forward,kind=kill"),
                                         ("fill", "step=2,rank=1,phase=forward,kind=kill")])
def test_four_ranks_share_the_gpu_through_a_kill(reference: dict, tmp_path: Path, policy: str, fail: str) -> None:
    params, report = train(tmp_path, nproc=4, pp=2, shared_device=True, policy=policy, fail=[fail])
    assert all(d.startswith("cuda") and "gloo" in d for d in report["devices"].values()), report["devices"]
    (failure,) = report["failures"]
    assert failure["ranks"] == [int(fail.split("rank=")[1].split(",")[0])]
    assert failure["policy"] == ("reroute" if policy == "fill" else policy) and failure["fill"] == (policy == "fill")
    assert report["steps"][-1]["alive"] == 3
    assert report["profile"].startswith("cuda")  # planned from the device rank 0 measured
    assert worst(params, reference) <= TOL
    assert [s["loss"] for s in report["steps"]] == pytest.approx(reference["losses"], abs=TOL)


@pytest.mark.parametrize("kind", ["error", "hang"])
def test_a_rank_error_or_hang_on_the_gpu_is_recovered_from(reference: dict, tmp_path: Path, kind: str) -> None:
    """A rank's own error (raised mid-backward while it holds a CUDA context) is reported as its own and
    recovered from; a SIGSTOPped rank is fenced by its missed heartbeats. Either way the survivors end
    equal to the fault-free CUDA run."""
    params, report = train(tmp_path, nproc=4, pp=2, shared_device=True,
                           fail=[f"step=1,rank=2,phase=backward,kind={kind}"])
    (failure,) = report["failures"]
    assert failure["ranks"] == [2]
    if kind == "error":
        assert failure["error"]["type"] == "InjectedError"
    else:
        assert failure["detection_s"] >= 4.0  # the heartbeat timeout (5 s), not an error
    assert worst(params, reference) <= TOL


MLM = os.environ.get("MEGATRON_LM_PATH")


@pytest.mark.skipif(not MLM or not (Path(MLM) / "pretrain_gpt.py").exists(),
                    reason="set MEGATRON_LM_PATH to a Megatron-LM checkout")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_pretrain_gpt_odyssey_on_one_gpu_logs_what_stock_logs(tmp_path: Path, precision: str) -> None:
    """fp16: Megatron's prepare_grads before the commit, the scaler's update held until the step
    (megatron_lm.loss_scale), with the scale, found-inf flag and gradients on the device."""
    from megatron_odyssey.megatron_lm.cpu_mode import with_fp16_loss_scaling
    from megatron_odyssey.testing.megatron_lm_job import gpu_gpt_flags, run_odyssey, run_stock, same_training

    flags = gpu_gpt_flags(8, layers=4, hidden=256, heads=8, seq=256, micro_batch=2, global_batch=8)
    if precision == "fp16":
        flags = with_fp16_loss_scaling([f for f in flags if f != "--bf16"])
    port = 29610 + 40 * (precision == "fp16")
    stock = run_stock(MLM, tmp_path / "stock", flags, port, nproc=1, gpu=True)
    assert stock.returncode == 0, stock.tail()
    job = run_odyssey(MLM, tmp_path / "odyssey", flags, port + 10, nproc=1, gpu=True)
    assert job.returncode == 0, job.tail()
    assert sorted(job.iterations()) == list(range(1, 9)) or precision == "fp16"  # (fp16: skipped ones log no norm)
    assert job.report["devices"]["0"].startswith("cuda") and "nccl" in job.report["devices"]["0"]
    assert same_training(job.iterations(), stock.iterations())
    assert job.loss_scales() == stock.loss_scales() and len(job.loss_scales()) == 8


#: the distributed optimizer in two instances with both overlaps: stock reduces the gradients twice there unless
#: told --no-align-grad-reduce (tests/runtime/test_megatron_lm.py), Odyssey once
SHARED_LAYOUTS = {"plain": ([], [], 4),
                  "distopt-overlapped": (["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2",
                                          "--overlap-grad-reduce", "--overlap-param-gather"], ["--no-align-grad-reduce"], 8)}


@pytest.mark.skipif(not MLM or not (Path(MLM) / "pretrain_gpt.py").exists(),
                    reason="set MEGATRON_LM_PATH to a Megatron-LM checkout")
@pytest.mark.parametrize("layout, policy", [("plain", "reroute"), ("plain", "reconfigure"),
                                            ("distopt-overlapped", "reroute")])
def test_pretrain_gpt_ranks_share_the_gpu_through_a_kill(tmp_path: Path, layout: str, policy: str) -> None:
    """Megatron-LM PP=2 in bf16 with its ranks sharing the one GPU (ODYSSEY_SHARED_DEVICE=1: every rank on device
    0, gloo, device tensors through host copies: runtime.host_staging), rank 1 killed in iteration 3's backward:
    the survivors' rebuilt stages, moved weights and optimizer state, executor and gradient sync on the device.
    Every iteration equals stock Megatron-LM's on the same shared device, to 5 significant digits (bf16; a
    reroute sums a stage's gradients over its survivors in another order)."""
    from megatron_odyssey.testing.megatron_lm_job import (gpu_gpt_flags, run_odyssey, run_stock, same_training,
                                                          shared_device_flags)

    extra, stock_only, nproc = SHARED_LAYOUTS[layout]
    flags = shared_device_flags([*gpu_gpt_flags(6, layers=4, hidden=256, heads=8, seq=256, micro_batch=1,
                                                global_batch=8, pipeline_parallel=2), *extra])
    port = 29710 + 40 * list(SHARED_LAYOUTS).index(layout) + 20 * (policy == "reconfigure")
    stock = run_stock(MLM, tmp_path / "stock", [*flags, *stock_only], port, nproc=nproc, gpu=True, shared="1")
    assert stock.returncode == 0, stock.tail()
    job = run_odyssey(MLM, tmp_path / "odyssey", [*flags, "--odyssey-heartbeat-timeout", "10", "--odyssey-policy",
                                                  policy, "--odyssey-inject-fault", "step=2,rank=1,phase=backward,kind=kill"],
                      port + 10, nproc=nproc, gpu=True, shared="1")
    assert job.returncode == 0, job.tail()
    (failure,) = job.report["failures"]
    assert failure["ranks"] == [1] and failure["policy"] == policy, failure
    assert all(d.startswith("cuda") and "gloo" in d for d in job.report["devices"].values()), job.report["devices"]
    assert sorted(job.iterations()) == list(range(1, 7))
    assert same_training(job.iterations(), stock.iterations(), rel=1e-5)


@pytest.mark.skipif(not MLM or not (Path(MLM) / "pretrain_gpt.py").exists(),
                    reason="set MEGATRON_LM_PATH to a Megatron-LM checkout")
def test_the_rerun_state_machine_validates_the_steps_after_a_failure_on_the_gpu(tmp_path: Path) -> None:
    """Megatron's result validation after the hand-off, with the device tensors it checks (megatron_lm.rerun): rank 1
    is killed in iteration 0, so every later iteration is a plan step; Megatron's own error injection at every
    validation (--error-injection-rate 1, transient) makes the survivors reject iteration 1, run it again in place
    (the machine's CUDA flags all-reduced over the survivors' world) and leave with 17, as stock does, after the
    checkpoint the machine asks for."""
    from megatron_odyssey.testing.megatron_lm_job import (gpu_gpt_flags, max_tensor_difference, read_torch_dist,
                                                          run_odyssey, run_stock, shared_device_flags)

    def flags(work: Path) -> list[str]:
        return [*shared_device_flags(gpu_gpt_flags(4, layers=4, hidden=256, heads=8, seq=256, micro_batch=1,
                                                   global_batch=8, pipeline_parallel=2)),
                "--rerun-mode", "validate_results", "--error-injection-rate", "1", "--error-injection-type",
                "transient_error", "--save", str(work / "ckpt"), "--save-interval", "100"]

    stock = run_stock(MLM, tmp_path / "stock", flags(tmp_path / "stock"), 29810, nproc=4, gpu=True, shared="1")
    assert "exitcode  : 17" in stock.logs, stock.tail()
    job = run_odyssey(MLM, tmp_path / "odyssey", [*flags(tmp_path / "odyssey"), "--odyssey-heartbeat-timeout", "10",
                                                  "--odyssey-inject-fault", "step=0,rank=1,phase=backward,kind=kill"],
                      29820, nproc=4, gpu=True, shared="1")
    assert job.returncode == 17, job.tail()
    (failure,) = job.report["failures"]
    assert failure["ranks"] == [1] and failure["step"] == 0
    assert all(d.startswith("cuda") and "gloo" in d for d in job.report["devices"].values()), job.report["devices"]
    ended = job.report["ended_by_script"]
    assert ended["code"] == 17 and ended["ranks"] == [0, 2, 3] and ended["step"] == 1, ended
    assert "Need to rerun step to check reproducibility of initial result" in job.logs
    assert "Possible transient error" in job.logs
    saved = (tmp_path / "stock" / "ckpt" / "iter_0000001" / ".metadata").exists()
    assert (tmp_path / "odyssey" / "ckpt" / "iter_0000001" / ".metadata").exists() == saved
    if saved:  # one Adam step at lr 1e-4 from the same start: bf16 gradients summed in another order after the kill
        assert max_tensor_difference(read_torch_dist(tmp_path / "odyssey" / "ckpt" / "iter_0000001"),
                                     read_torch_dist(tmp_path / "stock" / "ckpt" / "iter_0000001")) < 2e-4


@pytest.mark.gpu
def test_compute_is_timed_by_device_events_not_by_the_host() -> None:
    """The diagnosis' compute times on a GPU: the host only launches the kernels, the event pair read at the
    step's summary measures them (what the wall clock until they finished says)."""
    import time

    from megatron_odyssey.runtime.op_trace import ComputeTimer, OpTrace

    device = torch.device("cuda")
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):  # cuBLAS sets itself up on the first product, on the host (0.11 s of 20 launches, H200)
        a @ a
    trace = OpTrace(0, 0)
    trace.begin(0)
    timer = ComputeTimer.for_device(device, trace)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with timer.timing("forward"):
        for _ in range(50):  # ~1.4 ms each on an H100, a few microseconds to launch
            a @ a
    host = timer.last_s
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    trace.summary()
    (device_s,) = trace.forward_s
    assert device_s > 5 * host
    assert device_s == pytest.approx(wall, rel=0.25)
