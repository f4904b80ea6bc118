"""Megatron-LM's own ``pretrain_gpt.py``, with our patch applied, through real failures.

Needs a Megatron-LM checkout (branch core_r0.16.0 or a neighbour) with its Python requirements
importable: ``MEGATRON_LM_PATH=/path/to/Megatron-LM``; skipped otherwise. Four CPU ranks (gloo)
train a tiny Llama-style GPT on mock data (PP=2 x DP=2). The reference is stock Megatron-LM under
torchrun without ``--odyssey``; under ``odyssey-launch`` one rank is SIGKILLed mid-iteration, the
survivors recover in-process (rerouted or re-arranged pipelines) and finish, and every line
Megatron logs for an iteration (loss, grad norm, learning rate, consumed samples) equals the
reference's (loss and grad norm to the last printed digit).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_odyssey.testing.megatron_lm_job import run_odyssey, run_stock, same_training
from megatron_odyssey.megatron_lm.cpu_mode import tiny_gpt_flags

MLM = os.environ.get("MEGATRON_LM_PATH")

pytestmark = pytest.mark.skipif(not MLM or not (Path(MLM) / "pretrain_gpt.py").exists(),
                                reason="set MEGATRON_LM_PATH to a Megatron-LM checkout to run pretrain_gpt.py")

ITERS = 5
TINY_GPT = tiny_gpt_flags(ITERS)
ODYSSEY = [*TINY_GPT, "--odyssey-heartbeat-timeout", "10"]


def _port(offset: int) -> int:
    return 20000 + (os.getpid() * 7) % 20000 + offset


@pytest.fixture(scope="module")
def stock(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[str, ...]]:
    """Stock Megatron-LM (torchrun, no --odyssey): the fault-free reference."""
    job = run_stock(MLM, tmp_path_factory.mktemp("stock"), TINY_GPT, _port(0))
    assert job.returncode == 0, job.logs[-4000:]
    its = job.iterations()
    assert sorted(its) == list(range(1, ITERS + 1))
    return its


@pytest.mark.parametrize("policy", ["reroute", "reconfigure"])
def test_pretrain_gpt_survives_a_killed_rank(stock: dict, tmp_path: Path, policy: str) -> None:
    job = run_odyssey(MLM, tmp_path, [*ODYSSEY, "--odyssey-policy", policy, "--odyssey-inject-fault",
                                      "step=2,rank=1,phase=backward,kind=kill"], _port(10 if policy == "reroute" else 20))
    assert job.returncode == 0, job.logs[-4000:]
    report = job.report
    assert [s["step"] for s in report["steps"]] == list(range(ITERS))  # training continued and finished
    (failure,) = report["failures"]
    assert failure["ranks"] == [1] and failure["policy"] == policy
    # no survivor waited out a timeout (120 s): generation 0 is Megatron's own DDP and p2p, whose gloo
    # sockets its data-loader workers also hold (see world.shut_connections)
    assert failure["recovery_s"] < 30, failure
    assert report["steps"][-1]["alive"] == 3
    assert same_training(job.iterations(), stock)  # loss, grad norm, lr, consumed samples: as if nothing failed


def test_pretrain_gpt_rank_error_is_reported_and_recovered(stock: dict, tmp_path: Path) -> None:
    """A rank's own error (as a device bug would be) is not taken for a peer failure: its traceback
    reaches the launcher's terminal, the job goes on without the rank and trains as stock Megatron."""
    job = run_odyssey(MLM, tmp_path, [*ODYSSEY, "--odyssey-inject-fault", "step=2,rank=1,phase=backward,kind=error"],
                      _port(40))
    assert job.returncode == 0, job.logs[-4000:]
    (failure,) = job.report["failures"]
    assert failure["ranks"] == [1] and failure["error"]["type"] == "InjectedError"
    assert "rank 1 failed with its own error" in job.logs and "InjectedError: injected error" in job.logs
    assert [s["step"] for s in job.report["steps"]] == list(range(ITERS))
    assert same_training(job.iterations(), stock)


def test_two_machines_rank_on_the_second_dies(stock: dict, tmp_path: Path) -> None:
    """Two odyssey-launch processes stand for two machines (coordinator + node agent); the planner
    switches to the stage costs Megatron's timers measured in iteration 1."""
    job = run_odyssey(MLM, tmp_path, [*ODYSSEY, "--odyssey-inject-fault", "step=3,rank=3,phase=forward,kind=kill",
                                      "--odyssey-profile-iters", "1"], _port(30), nodes=2)
    assert job.returncode == 0, job.logs[-4000:]
    report = job.report
    (failure,) = report["failures"]
    assert failure["ranks"] == [3]
    assert [s["step"] for s in report["steps"]] == list(range(ITERS))
    assert report["profile"] == "measured"  # planned from Megatron's timers after iteration 1
    assert same_training(job.iterations(), stock)


def test_bf16_state_moves_through_main_params(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """--bf16: the optimizer steps fp32 main copies of bf16 parameters. A reconfiguration must move the
    main copies and their Adam state (not the bf16 model weights) and then refresh the model weights from
    them; every logged iteration then equals stock bf16 Megatron-LM's."""
    flags = [*TINY_GPT, "--bf16"]
    stock = run_stock(MLM, tmp_path_factory.mktemp("stock_bf16"), flags, _port(40))
    assert stock.returncode == 0, stock.logs[-4000:]
    job = run_odyssey(MLM, tmp_path, [*flags, "--odyssey-heartbeat-timeout", "10", "--odyssey-policy", "reconfigure",
                                      "--odyssey-inject-fault", "step=2,rank=1,phase=backward,kind=kill"], _port(50))
    assert job.returncode == 0, job.logs[-4000:]
    (failure,) = job.report["failures"]
    assert failure["policy"] == "reconfigure"
    ranges = {tuple(st["layers"]) for pipe in job.report["final_plan"]["pipelines"] for st in pipe["stages"]}
    assert ranges - {(0, 2), (2, 4)}  # some survivor took layers it did not hold: their state moved
    assert same_training(job.iterations(), stock.iterations())


def test_per_token_loss_after_a_reroute(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """--calculate-per-token-loss: after the failure the executor normalises by the global batch's loss
    tokens, which the rank counts from the dataset (GenerationRank.token_count); every logged iteration
    equals stock Megatron-LM's."""
    flags = [*TINY_GPT, "--calculate-per-token-loss"]
    stock = run_stock(MLM, tmp_path_factory.mktemp("stock_per_token"), flags, _port(60))
    assert stock.returncode == 0, stock.logs[-4000:]
    job = run_odyssey(MLM, tmp_path, [*flags, "--odyssey-heartbeat-timeout", "10", "--odyssey-policy", "reroute",
                                      "--odyssey-inject-fault", "step=2,rank=1,phase=backward,kind=kill"], _port(70))
    assert job.returncode == 0, job.logs[-4000:]
    (failure,) = job.report["failures"]
    assert failure["policy"] == "reroute"
    assert same_training(job.iterations(), stock.iterations())
