"""Which samples a global micro-batch holds, whichever rank runs it after a failure.

Megatron's sampler gives data-parallel rank ``d`` (of generation 0's ``DP``) the ``k``-th micro-batch of each
iteration; Odyssey numbers it ``j = k * DP + d`` and any rank may run it once a plan reroutes or re-arranges
the pipelines. With ``--dataloader-type single`` that micro-batch is a contiguous run of samples of the
global order. With ``--dataloader-type cyclic`` each rank's samples are a shuffled stream keyed to its rank
and the data-parallel size: Megatron's ``MegatronPretrainingRandomSampler`` draws, per epoch, a permutation
seeded by the epoch number, of the rank's own bucket of samples (``--data-sharding``, the default) or of all
samples, of which rank ``d`` takes every ``DP``-th from ``d``; a sampler started mid-epoch yields the rest of
the same order. A survivor computes rank ``d``'s order of the epoch once, as a tensor (the sampler's own
Python list of every index costs seconds per million samples and would land in the first step after a
recovery), and answers any position of it. The arithmetic mirrors the sampler's of every release
(core_r0.12.0 to main, the same code); the tests compare it with the sampler itself.
"""
from __future__ import annotations

from typing import Any

import torch

from .batch_ramp import BatchRamp

DATALOADER_TYPES = ("single", "cyclic")


class GlobalMicroBatches:
    """Sample indices of global micro-batch ``j`` of iteration ``step`` for a job of ``global_batch`` samples
    per iteration in micro-batches of ``micro_batch`` over ``data_parallel`` ranks (generation 0's)."""

    def __init__(self, dataset: Any, micro_batch: int, global_batch: int, data_parallel: int,
                 dataloader_type: str = "single", data_sharding: bool = True, ramp: BatchRamp | None = None):
        """``ramp``: the job's batch-size ramp (``batch_ramp``), past which ``global_batch`` holds."""
        if dataloader_type not in DATALOADER_TYPES:
            raise ValueError(f"--dataloader-type {dataloader_type}: Odyssey reads {' and '.join(DATALOADER_TYPES)}")
        stride = micro_batch * data_parallel
        if dataloader_type == "cyclic" and not data_sharding and len(dataset) % stride:
            # without sharding rank d's epoch holds floor((N - d) / DP) / mbs micro-batches of a shuffle of N: the
            # ranks' epochs end at different points, and a stream rebuilt for a dead rank could not know where
            raise ValueError(f"--dataloader-type cyclic --no-data-sharding: the training split's {len(dataset)} samples "
                             f"are not a multiple of micro-batch x data-parallel size ({stride}), so Megatron's ranks "
                             f"start their epochs at different samples, which Odyssey cannot follow for a dead rank; "
                             f"drop --no-data-sharding")
        self.dataset, self.micro_batch, self.global_batch = dataset, micro_batch, global_batch
        self.data_parallel, self.dataloader_type, self.data_sharding = data_parallel, dataloader_type, data_sharding
        self.ramp = ramp
        self._epoch: int | None = None  # the epoch whose orders are kept
        self._orders: dict[int | str, torch.Tensor] = {}  # rank d -> its samples of that epoch, in order

    def indices(self, step: int, j: int) -> list[int]:
        start = self.ramp.samples_before(step) if self.ramp is not None else step * self.global_batch
        if self.dataloader_type == "single":
            first = start + j * self.micro_batch
            return list(range(first, first + self.micro_batch))
        k, d = divmod(j, self.data_parallel)
        return self._batch_of(d, start + k * self.micro_batch * self.data_parallel)

    def _batch_of(self, d: int, consumed: int) -> list[int]:
        """Rank ``d``'s micro-batch at ``consumed`` samples (the job's count, as every rank's sampler keeps it)."""
        n, mbs, stride = len(self.dataset), self.micro_batch, self.micro_batch * self.data_parallel
        epoch, offset = divmod(consumed, n - n % stride)  # an epoch's samples: the ragged end is dropped
        i = offset // stride  # rank d's i-th micro-batch of the epoch
        return self._order(d, epoch)[i * mbs:(i + 1) * mbs].tolist()

    def _order(self, d: int, epoch: int) -> torch.Tensor:
        """Rank ``d``'s samples of ``epoch`` in the order its sampler yields them from the epoch's start."""
        if self._epoch != epoch:
            self._epoch, self._orders = epoch, {}
        if d not in self._orders:
            n, mbs, dp = len(self.dataset), self.micro_batch, self.data_parallel
            g = torch.Generator()
            g.manual_seed(epoch)
            if self.data_sharding:  # the rank's own bucket of (n // (mbs dp)) micro-batches, shuffled
                bucket = (n // (mbs * dp)) * mbs
                self._orders[d] = torch.randperm(bucket, generator=g) + d * bucket
            else:  # every dp-th of one shuffle of all whole micro-batches' samples
                if "all" not in self._orders:
                    self._orders["all"] = torch.randperm((n // mbs) * mbs, generator=g)
                self._orders[d] = self._orders["all"][d::dp]
        return self._orders[d]
