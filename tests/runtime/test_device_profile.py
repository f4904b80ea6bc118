"""The profile of a Megatron job as the agent builds it: Megatron's arguments -> TrainConfig -> analytic
profile on the device rank 0 measured, link flags, and the --odyssey-profile-iters calibration."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from megatron_odyssey.arguments import OdysseyArgumentError, add_odyssey_args, validate_odyssey_args
from megatron_odyssey.planning.analytic import BF16, ModelShape, analytic_profile
from megatron_odyssey.planning.devices import Layout, device_params
from megatron_odyssey.planning.estimator import estimate_step
from megatron_odyssey.runtime.config import TrainConfig
from megatron_odyssey.runtime.device_profile import calibrated_profile, job_profile, measure_device, symmetric
from megatron_odyssey.megatron_lm.rank import config_from_megatron_args

GiB = 2**30


def megatron_args(argv: list[str] = (), **kw: object) -> argparse.Namespace:
    ns = add_odyssey_args(argparse.ArgumentParser()).parse_args(["--odyssey", *argv])
    base = dict(world_size=32, tensor_model_parallel_size=2, pipeline_model_parallel_size=4, num_layers=16,
                hidden_size=4096, num_attention_heads=32, group_query_attention=True, num_query_groups=8,
                seq_length=4096, global_batch_size=64, micro_batch_size=1, train_iters=10, seed=1,
                ffn_hidden_size=11008, padded_vocab_size=32000, lr=1e-4, distributed_backend="nccl", iteration=0,
                bf16=True, swiglu=True, sequence_parallel=True, transformer_impl="transformer_engine",
                attention_backend="AttnBackend.auto", attention_dropout=0.0, hidden_dropout=0.0,
                add_bias_linear=False, normalization="RMSNorm", save="/ckpt", save_interval=100)
    base.update(kw)
    for k, v in base.items():
        setattr(ns, k, v)
    return ns


def test_megatron_job_is_planned_from_its_shape_precision_and_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cfg = config_from_megatron_args(megatron_args(["--odyssey-p2p-bandwidth", "50"]))
    cfg.extra["device"] = {"kind": "cuda", "name": "h100", "flops": 790e12, "memory_bytes": 80 * GiB}
    cfg = TrainConfig(**json.loads(json.dumps(cfg.__dict__)))  # as the agent reads it from the store
    prof = job_profile(cfg)
    shape = ModelShape(num_layers=16, hidden=4096, ffn_hidden=11008, heads=32, query_groups=8, vocab=32000,
                       seq_length=4096, micro_batch=1, tp=2, sequence_parallel=True, flash_attention=True)
    dev = device_params("cuda", Layout(2, 4, 4, 8), flops=790e12, memory_bytes=80 * GiB, p2p_GBps=50)
    expected = analytic_profile(shape, BF16, dev)
    assert prof.layers == expected.layers and prof.output == expected.output
    assert prof.p2p_s == expected.p2p_s and prof.device_memory_bytes == int(0.9 * 80 * GiB)
    assert prof.allreduce_bandwidth_Bps == 150e9  # TP x DP = 8 ranks: one server, NVLink
    assert prof.layers[0].param_bytes == 2 * (prof.layers[0].grad_bytes // 4)  # bf16 weights, fp32 main grads
    step = estimate_step(symmetric(cfg), prof).step_time_s
    assert prof.checkpoint_interval_s == pytest.approx(100 * step)  # --save-interval 100 iterations
    # the local spec keeps the softmax probabilities: more activation memory
    local = config_from_megatron_args(megatron_args(transformer_impl="local"))
    assert local.extra["model"]["flash_attention"] is False and local.extra["precision"] == "bf16"


def test_cpu_jobs_keep_the_cpu_constants() -> None:
    assert measure_device(torch.device("cpu"), torch.float32) == {"kind": "cpu"}
    prof = job_profile(TrainConfig())
    layer = prof.layers[0]
    assert layer.param_bytes == layer.grad_bytes and layer.optimizer_bytes == 2 * layer.param_bytes  # fp32 Adam
    assert prof.restart_overhead_s == 10.0 and prof.allreduce_bandwidth_Bps == 1e9
    assert prof.device_memory_bytes == 8 * GiB


def test_profile_iters_calibration_matches_the_measured_forward_backward() -> None:
    cfg = TrainConfig(nproc=8, tp=1, pp=4, layers=8, hidden=256, heads=4, seq=64, global_batch=16)
    base = job_profile(cfg)
    est = estimate_step(symmetric(cfg), base)
    measured = 4 * (est.compute_s + est.sync_s)
    cal = calibrated_profile(cfg, measured, base=base)
    again = estimate_step(symmetric(cfg), cal.profile)
    assert again.compute_s + again.sync_s == pytest.approx(measured, rel=1e-6)
    assert cal.profile.name == "measured" and cal.factor > 3


def _args(argv: list[str]) -> argparse.Namespace:
    ns = add_odyssey_args(argparse.ArgumentParser()).parse_args(argv)
    for k, v in dict(world_size=8, data_parallel_size=2, train_iters=10).items():
        setattr(ns, k, v)
    return ns


def test_link_flags_parse() -> None:
    ns = _args(["--odyssey", "--odyssey-p2p-bandwidth", "50", "--odyssey-allreduce-bandwidth", "40",
                "--odyssey-transfer-bandwidth", "12.5"])
    validate_odyssey_args(ns)
    assert (ns.odyssey_p2p_bandwidth, ns.odyssey_allreduce_bandwidth, ns.odyssey_transfer_bandwidth) == (50, 40, 12.5)


@pytest.mark.parametrize("flag", ["--odyssey-p2p-bandwidth", "--odyssey-allreduce-bandwidth",
                                  "--odyssey-transfer-bandwidth"])
@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf"])
def test_bad_link_bandwidth_names_the_flag(flag: str, value: str) -> None:
    with pytest.raises(OdysseyArgumentError, match=f"{flag} must be a positive number of GB/s"):
        validate_odyssey_args(_args(["--odyssey", flag, value]))


def test_non_numeric_bandwidth_and_stray_flag(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        _args(["--odyssey", "--odyssey-p2p-bandwidth", "fast"])
    assert "--odyssey-p2p-bandwidth" in capsys.readouterr().err
    with pytest.raises(OdysseyArgumentError, match="--odyssey-transfer-bandwidth given without --odyssey"):
        validate_odyssey_args(_args(["--odyssey-transfer-bandwidth", "10"]))
