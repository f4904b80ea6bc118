"""The loss a step commits equals what Megatron-LM's train_step prints, in its float arithmetic and order."""
from __future__ import annotations

import pytest

from megatron_odyssey.runtime.step_loss import committed_loss, ready_shares


def test_committed_loss_is_megatrons_token_weighted_mean() -> None:
    """Megatron's train_step: sum of every micro-batch's loss sum over every DP rank / sum of their tokens."""
    shares = [b"12.5 5.0", b"0.0", b"7.5 3.0", b"0.0"]  # two last-stage ranks (loss sum, tokens), two others
    assert committed_loss(shares) == pytest.approx((12.5 + 7.5) / (5.0 + 3.0))
    assert committed_loss([b"1.25", b"0.75", b"0.0"]) == pytest.approx(2.0)  # shares of a normalised loss
    shares = ready_shares(b"3=1.25;0=0.75;12=12.5 5.0;")  # the step's appended key, in arrival order
    assert shares == {3: b"1.25", 0: b"0.75", 12: b"12.5 5.0"}


def test_plan_step_loss_is_added_up_in_fp32_as_megatrons_ranks_would() -> None:
    """Micro-batch loss sums from wherever a plan ran them, added up as Megatron-LM's train_step on DP=2 ranks
    does: each rank's micro-batches j = 2 k + d in fp32 (vstack + sum), the two ranks' totals (all-reduce), an
    fp32 quotient. Summing the means, or in float64, differs in the last printed digit of such losses."""
    import random

    import torch

    rng = random.Random(3)
    for _ in range(200):
        parts = {j: (float(torch.tensor(rng.uniform(150.0, 300.0), dtype=torch.float32)), 32.0) for j in range(8)}
        per_rank = [torch.vstack([torch.tensor(parts[j]) for j in range(d, 8, 2)]).sum(dim=0) for d in range(2)]
        total = per_rank[0] + per_rank[1]
        expected = float(total[0] / total[1])
        # the plan ran micro-batches 0-2 and 6 on one last stage, 3-5 and 7 on another; a third rank has none
        shares = [b"p" + b"".join(b" %d:%r:%r" % (j, *parts[j]) for j in (6, 0, 1, 2)), b"p",
                  b"p" + b"".join(b" %d:%r:%r" % (j, *parts[j]) for j in (3, 4, 5, 7))]
        assert committed_loss(shares, data_parallel=2) == expected


def test_core_r0_12s_loss_is_added_up_micro_batch_by_micro_batch() -> None:
    """core_r0.12.0's pretrain_gpt.py all-reduces each micro-batch's (loss sum, tokens) over the DP=2 ranks, and its
    train_step adds those up over the micro-batches in order (numerator += val[0]): another fp32 order, which the
    agent follows for that release (the rank-first order differed by 2 in the last printed digit of a join test)."""
    import random

    import torch

    rng = random.Random(5)
    differs = 0
    for _ in range(200):
        parts = {j: (float(torch.tensor(rng.uniform(150.0, 300.0), dtype=torch.float32)), 32.0) for j in range(8)}
        numerator, denominator = 0, 0
        for k in range(4):
            reduced = torch.tensor(parts[2 * k]) + torch.tensor(parts[2 * k + 1])  # the all-reduce of two ranks
            numerator, denominator = numerator + reduced[0], denominator + reduced[1]
        expected = float(numerator / denominator)
        shares = [b"p" + b"".join(b" %d:%r:%r" % (j, *parts[j]) for j in (6, 0, 1, 2)), b"p",
                  b"p" + b"".join(b" %d:%r:%r" % (j, *parts[j]) for j in (3, 4, 5, 7))]
        assert committed_loss(shares, data_parallel=2, per_micro_batch=True) == expected
        differs += committed_loss(shares, data_parallel=2) != expected
    assert differs > 0  # the orders are not the same sum
