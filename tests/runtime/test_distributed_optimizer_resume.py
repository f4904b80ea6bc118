"""Megatron's distributed optimizer resumed from its own checkpoint with torch's Adam (every CPU; any GPU without
Apex or Transformer Engine), with the megatron-core wheel only: two real gloo ranks, megatron-core's DDP and
DistributedOptimizer, dist_checkpointing's save and load as Megatron-LM's checkpointing calls them. With the
CPU-mode wrappers (megatron_lm.cpu_mode) a resume trains on bit for bit; each wrapper put back to Megatron's own
method shows the stock failure it answers (as the wheel, megatron-core 0.16.1, and checkouts' own megatron.core 0.15
on have it: run with a checkout first on PYTHONPATH). (The relaunch of a whole Megatron-LM job is a checkout test:
test_megatron_lm.py's test_a_relaunch_resumes_from_the_distributed_optimizer_checkpoint_saved_after_a_failure.)"""
from __future__ import annotations

import pytest
import torch

from _runtime_workers import distributed_optimizer_resume_worker, spawn_bounded
from megatron_odyssey.megatron_lm.cpu_mode import _before_016
from megatron_odyssey.megatron_lm.replica_optimizer import supported

WORLD = 2
DTYPES = ["float32", "bfloat16"]
#: Megatron-LM's default format, and the layout-free one (``--dist-ckpt-optim-fully-reshardable``)
FORMATS = ["dp_reshardable", "fully_reshardable"]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every case from one spawn (each process imports megatron-core once): (wrapper put back or None, dtype,
    format) -> each rank's outcome."""
    if not supported():
        pytest.skip("this megatron-core's distributed optimizer has no layout-free checkpoint format (0.15 on)")
    tmp = tmp_path_factory.mktemp("resume")
    out = tmp / "outcomes.pt"
    spawn_bounded(distributed_optimizer_resume_worker, (WORLD, str(tmp / "store"), str(tmp), str(out)), WORLD,
                  timeout_s=600)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_resume_trains_on_bit_for_bit(outcomes: dict, dtype: str, fmt: str) -> None:
    """Saved after step 2, loaded into a fresh model and optimizer, steps 3 and 4 give the weights of the run that
    never stopped, exactly; every parameter's Adam state counts 4 steps in a tensor of its own."""
    for rank in outcomes[(None, dtype, fmt)]:
        assert "error" not in rank, rank
        assert rank["max_diff"] == 0.0
        assert rank["steps"] and set(rank["steps"]) == {4.0}
        assert rank["step_tensors"] == len(rank["steps"])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_stock_cannot_make_the_load_template_before_a_step(outcomes: dict, dtype: str, fmt: str) -> None:
    """Megatron's ``state_dict`` reads the step off torch's per-parameter state, still empty before the load."""
    for rank in outcomes[("state_dict", dtype, fmt)]:
        assert (rank.get("error"), rank.get("in")) == ("AssertionError", "state_dict"), rank


def test_stock_copies_into_the_step_under_autograd(outcomes: dict) -> None:
    """Megatron's ``_set_main_param_and_optimizer_states``: the layout-free format has no per-parameter ``step``;
    the default format's loader runs with autograd on (an fp32 job's main parameters are views of its weights), and
    where the copy goes through (bf16's own fp32 copies) it sets every step back to the template's 0: two steps
    after the load Adam counts 2, not 4, and the weights leave the uninterrupted run's."""
    without = "_set_main_param_and_optimizer_states"
    for dtype in DTYPES:
        for rank in outcomes[(without, dtype, "fully_reshardable")]:
            assert (rank.get("error"), rank.get("message")) == ("KeyError", "'step'"), rank
    for rank in outcomes[(without, "float32", "dp_reshardable")]:
        assert rank.get("error") == "RuntimeError" and "view of a leaf Variable" in rank["message"], rank
    for rank in outcomes[(without, "bfloat16", "dp_reshardable")]:
        if _before_016():  # 0.15's default format saves no per-parameter step either (cpu_mode._no_step_in_bucket_state)
            assert (rank.get("error"), rank.get("message")) == ("KeyError", "'step'"), rank
        else:
            assert set(rank["steps"]) == {2.0} and rank["max_diff"] > 0, rank


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_stock_shares_one_step_tensor_that_adam_advances_once_per_parameter(outcomes: dict, dtype: str,
                                                                           fmt: str) -> None:
    """Megatron's ``load_state_dict`` gives every parameter the same step tensor: each of a rank's n parameters
    advances it in place, so after two steps it counts 2 + 2n, and the bias correction moves the weights."""
    for rank in outcomes[("load_state_dict", dtype, fmt)]:
        n = len(rank["steps"])
        assert rank["step_tensors"] == 1 and set(rank["steps"]) == {2.0 + 2 * n}, rank
        assert rank["max_diff"] > 0
