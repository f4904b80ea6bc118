"""The agent's bookkeeping that the report and the Megatron host rely on: the committed loss from every
rank's ready value, Megatron's checkpoint tracker, and the step log written as steps commit."""
from __future__ import annotations

import json

import pytest

from megatron_odyssey.runtime.agent import committed_loss, megatron_checkpoint_iteration
from megatron_odyssey.runtime.step_log import StepLog


def test_committed_loss_is_megatrons_token_weighted_mean() -> None:
    """Megatron's train_step: sum of every micro-batch's loss sum over every DP rank / sum of their tokens."""
    shares = [b"12.5 5.0", b"0.0", b"7.5 3.0", b"0.0"]  # two last-stage ranks (loss sum, tokens), two others
    assert committed_loss(shares) == pytest.approx((12.5 + 7.5) / (5.0 + 3.0))
    assert committed_loss([b"1.25", b"0.75", b"0.0"]) == pytest.approx(2.0)  # shares of a normalised loss


def test_megatron_checkpoint_tracker(tmp_path) -> None:
    assert megatron_checkpoint_iteration(None) is None
    assert megatron_checkpoint_iteration(str(tmp_path)) is None  # nothing saved yet
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4\n")
    assert megatron_checkpoint_iteration(str(tmp_path)) == 4
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    assert megatron_checkpoint_iteration(str(tmp_path)) is None


def test_step_log_keeps_the_last_record_of_a_redone_step(tmp_path) -> None:
    log = StepLog(tmp_path / "r.steps.jsonl")
    for step, loss in ((0, 5.0), (1, 4.9), (2, 4.8), (1, 4.95), (2, 4.85), (3, 4.7)):  # restart from step 0's checkpoint
        log.append({"step": step, "loss": loss, "redone": log.was_trained(step)})
    records = log.records()
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert [r["loss"] for r in records] == [5.0, 4.95, 4.85, 4.7]
    assert [r["redone"] for r in records] == [False, True, True, False]
    assert len((tmp_path / "r.steps.jsonl").read_text().splitlines()) == 6  # every commit is on disk, in order
    assert json.loads((tmp_path / "r.steps.jsonl").read_text().splitlines()[3])["loss"] == 4.95
