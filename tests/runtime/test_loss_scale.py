"""--fp16's dynamic loss scale under the step commit (megatron_lm.loss_scale), with megatron-core's own
mixed-precision optimizer and ``DynamicGradScaler`` on two real gloo ranks: the scaler changes with the committed
step only, a plan step unscales by the loss scale and the backward's data-parallel factor and takes the decision
agreed before the commit, and a rebuilt optimizer keeps the scale."""
from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from _runtime_workers import loss_scale_worker

WORLD = 2


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("loss_scale")
    out = tmp / "record.pt"
    mp.spawn(loss_scale_worker, args=(WORLD, str(tmp / "store"), str(out)), nprocs=WORLD, join=True)
    return torch.load(out, weights_only=False)


def test_an_overflow_found_before_the_commit_changes_the_scale_only_with_the_step(record: dict) -> None:
    """Generation 0: Megatron's own prepare_grads finds the inf before the commit, but the scale is still 1024
    until the step runs (a step redone after a failure must start from it); the step then skips the update and
    halves the scale once (hysteresis 1), not twice."""
    assert record["overflow"] is True
    assert record["scale_before_commit"] == 1024.0
    assert record["step1"] is False and record["unchanged"]
    assert record["scale_after_skip"] == 512.0


def test_a_plan_step_unscales_by_the_scale_and_the_data_parallel_factor(record: dict) -> None:
    """Gradients left at 512 x 2 x g (loss scale x generation 0's DP): the main gradients the optimizer steps are
    g exactly, the norm is |g| exactly (powers of two), and the scale grows once (growth interval 1)."""
    g = torch.arange(12, dtype=torch.float32).reshape(4, 3) / 8
    assert record["norm"] == float(g.norm() * 512.0 * 2) / (512.0 * 2)
    assert record["norm_inf"] is None and record["norm_nan"] is None  # an overflow: stock prints no norm either
    assert record["step2"] is True and record["main_grad_unscaled"] and record["changed"]
    assert record["scale_after_step"] == 1024.0


def test_a_rebuilt_optimizer_keeps_the_scale_and_its_trackers(record: dict) -> None:
    assert record["rebuilt_scale"] == record["scale_after_step"] == 1024.0
    assert record["rebuilt_trackers"] == record["trackers"]
