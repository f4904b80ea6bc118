"""Which samples a global micro-batch holds (megatron_lm.samples). Megatron-LM's cyclic sampler itself needs a
Megatron-LM checkout: its streams are checked in test_megatron_lm.py."""
import pytest

from megatron_odyssey.megatron_lm.samples import GlobalMicroBatches


def test_single_is_the_global_order_whoever_asks():
    """Global batch 8 in micro-batches of 2 over DP=2: iteration 3 starts at sample 24; micro-batch j = k * DP + d
    is rank d's k-th, samples 24 + 2 j and 25 + 2 j."""
    samples = GlobalMicroBatches(list(range(100)), 2, 8, 2)
    assert [samples.indices(3, j) for j in range(4)] == [[24, 25], [26, 27], [28, 29], [30, 31]]
    assert samples.indices(0, 3) == [6, 7]


def test_unknown_loader_is_refused():
    with pytest.raises(ValueError, match="--dataloader-type external"):
        GlobalMicroBatches(list(range(10)), 1, 4, 2, "external")


def test_cyclic_without_sharding_on_a_ragged_split_is_refused():
    """Without --data-sharding, 41 samples over 4 ranks: rank 0's epoch holds 11 micro-batches, the others' 10,
    so the ranks' epochs drift apart; refused at start-up with the flag to drop."""
    with pytest.raises(ValueError, match="41 samples are not a multiple of micro-batch x data-parallel size"):
        GlobalMicroBatches(list(range(41)), 1, 8, 4, "cyclic", data_sharding=False)
    GlobalMicroBatches(list(range(41)), 1, 8, 4, "cyclic", data_sharding=True)  # with sharding: equal buckets
    GlobalMicroBatches(list(range(40)), 1, 8, 4, "cyclic", data_sharding=False)
