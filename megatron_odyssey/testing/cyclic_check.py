"""``python -m megatron_odyssey.testing.cyclic_check`` with a Megatron-LM checkout importable: every global
micro-batch ``megatron_lm.samples`` computes for ``--dataloader-type cyclic``, asked for in order, shuffled,
or with a rank's share skipped, holds the samples that release's own ``MegatronPretrainingRandomSampler``
gives its data-parallel rank through several epochs (``cyclic_iter``), with and without data sharding, and
a ragged split without sharding is refused. Prints ``ok``; raises otherwise."""
from __future__ import annotations

import importlib
import random

from megatron_odyssey.megatron_lm.samples import GlobalMicroBatches

CASES = ((40, 1, 4, True), (37, 1, 4, True), (38, 2, 2, True), (40, 1, 4, False), (42, 2, 3, False), (45, 3, 2, True))


def _sampler_class():
    from megatron_odyssey.megatron_lm.versions import provide_python312_names

    provide_python312_names()  # Megatron-LM 0.17+ on Python 3.11, as the adaptor does in a job
    for module in ("megatron.training.datasets.data_samplers", "megatron.legacy.data.data_samplers"):
        try:
            return importlib.import_module(module).MegatronPretrainingRandomSampler
        except ImportError:
            continue
    raise ImportError("no MegatronPretrainingRandomSampler in this checkout")


def main() -> None:
    sampler_class, rng = _sampler_class(), random.Random(0)
    for size, mbs, dp, sharding in CASES:
        gbs, data = mbs * dp * 2, list(range(size))
        streams = []  # each rank's micro-batches as Megatron's cyclic_iter gives them, over several epochs
        for d in range(dp):
            sampler = sampler_class(data, total_samples=size, consumed_samples=0, micro_batch_size=mbs,
                                    data_parallel_rank=d, data_parallel_size=dp, data_sharding=sharding)
            out: list[list[int]] = []
            while len(out) < 4 * size:
                out += list(sampler)
            streams.append(out)
        wanted = [(step, j) for step in range(3 * size // gbs) for j in range(gbs // mbs)]
        for order in (wanted, rng.sample(wanted, len(wanted)), [w for w in wanted if w[1] % dp != 1]):
            samples = GlobalMicroBatches(data, mbs, gbs, dp, "cyclic", sharding)
            for step, j in order:
                k, d = divmod(j, dp)
                got, expected = samples.indices(step, j), streams[d][step * (gbs // (mbs * dp)) + k]
                assert got == expected, (size, mbs, dp, sharding, step, j, got, expected)
    try:
        GlobalMicroBatches(list(range(41)), 1, 8, 4, "cyclic", False)
    except ValueError as exc:
        assert "drop --no-data-sharding" in str(exc)
    else:
        raise AssertionError("no error for a split whose ranks start their epochs at different samples")
    print("ok")


if __name__ == "__main__":
    main()
