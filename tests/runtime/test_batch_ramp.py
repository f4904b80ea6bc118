"""Megatron's batch-size ramp with --odyssey (megatron_lm.batch_ramp): where the ramp ends, by Megatron's own
calculator against a hand computation, and the samples each iteration past it reads. (A job through a kill after
the ramp, and one stopped by a kill inside it: test_megatron_lm.py.)"""
from __future__ import annotations

from argparse import Namespace

import pytest

pytest.importorskip("megatron.core")

from megatron_odyssey.megatron_lm.batch_ramp import BatchRamp, megatron_batch_ramp  # noqa: E402
from megatron_odyssey.megatron_lm.samples import GlobalMicroBatches  # noqa: E402


def _args(**kw) -> Namespace:
    base = dict(rampup_batch_size=None, global_batch_size=12, micro_batch_size=1, data_parallel_size=2,
                decrease_batch_size_if_needed=False, seq_length=32)
    return Namespace(**{**base, **kw})


def test_the_ramp_ends_where_megatrons_calculator_reaches_the_global_batch() -> None:
    """--rampup-batch-size 4 4 24 to 12: 24 samples over two increments of 4, one every 12 samples; Megatron
    raises the batch once the samples consumed so far pass each mark: 4, 4, 4 (12 consumed), 8, 8 (28 > 24),
    then 12 from iteration 6 (step 5) on, after 28 samples."""
    ramp = megatron_batch_ramp(_args(rampup_batch_size=["4", "4", "24"]))
    assert ramp == BatchRamp(ramp_end=5, ramp_samples=28, global_batch=12)
    assert [ramp.samples_before(s) for s in (5, 6, 7)] == [28, 40, 52]
    with pytest.raises(ValueError, match="iteration 5 is inside the batch-size ramp, which ends at iteration 6"):
        ramp.samples_before(4)
    assert megatron_batch_ramp(_args()) is None  # a constant batch
    assert BatchRamp.from_list(ramp.to_list()) == ramp and BatchRamp.from_list(None) is None


def test_the_tiny_jobs_ramp() -> None:
    """The ramp of test_megatron_lm's job: --rampup-batch-size 4 2 16 to 8 over DP=2: 4, 4, 6, 6, then 8 from
    iteration 5 (step 4), after 20 samples."""
    assert megatron_batch_ramp(_args(rampup_batch_size=["4", "2", "16"], global_batch_size=8)) == BatchRamp(4, 20, 8)


def test_micro_batches_past_the_ramp_read_from_where_it_ended() -> None:
    """Global micro-batch j of step s reads samples_before(s) + j * micro-batch on, not s x global batch."""
    ramp = BatchRamp(ramp_end=5, ramp_samples=28, global_batch=12)
    data = GlobalMicroBatches(list(range(1000)), 2, 12, 2, ramp=ramp)
    assert data.indices(6, 0) == [40, 41] and data.indices(6, 5) == [50, 51]
    assert GlobalMicroBatches(list(range(1000)), 2, 12, 2).indices(6, 0) == [72, 73]
