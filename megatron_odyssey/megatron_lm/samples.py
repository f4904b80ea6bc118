"""Which samples a global micro-batch holds, whichever rank runs it after a failure.

Megatron's sampler gives data-parallel rank ``d`` (of generation 0's ``DP``) the ``k``-th micro-batch of each
iteration; Odyssey numbers it ``j = k * DP + d`` and any rank may run it once a plan reroutes or re-arranges
the pipelines. With ``--dataloader-type single`` that micro-batch is a contiguous run of samples of the
global order. With ``--dataloader-type cyclic`` each rank's samples are a shuffled stream keyed to its rank
and the data-parallel size (per epoch, with or without ``--data-sharding``): a survivor asks Megatron's own
``MegatronPretrainingRandomSampler``, built for rank ``d`` at the start of the epoch, for rank ``d``'s
micro-batches of that epoch, and keeps the list (rank ``d`` kept the same shuffle), so micro-batches may be
asked for in any order.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

DATALOADER_TYPES = ("single", "cyclic")


def _random_sampler_class() -> Any:
    """Megatron-LM's cyclic sampler: megatron.training.datasets from core_r0.16.0, megatron.legacy.data before."""
    for module in ("megatron.training.datasets.data_samplers", "megatron.legacy.data.data_samplers"):
        try:
            return importlib.import_module(module).MegatronPretrainingRandomSampler
        except (ImportError, AttributeError):
            continue
    raise ImportError("Megatron-LM's MegatronPretrainingRandomSampler (--dataloader-type cyclic) was not found")


@dataclass
class _Epoch:
    """Rank ``d``'s micro-batches (sample indices) of one epoch, as Megatron's sampler lists them from its start."""

    epoch: int
    batches: list[list[int]]


class GlobalMicroBatches:
    """Sample indices of global micro-batch ``j`` of iteration ``step`` for a job of ``global_batch`` samples
    per iteration in micro-batches of ``micro_batch`` over ``data_parallel`` ranks (generation 0's)."""

    def __init__(self, dataset: Any, micro_batch: int, global_batch: int, data_parallel: int,
                 dataloader_type: str = "single", data_sharding: bool = True):
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
        self._epochs: dict[int, _Epoch] = {}

    def indices(self, step: int, j: int) -> list[int]:
        if self.dataloader_type == "single":
            first = step * self.global_batch + j * self.micro_batch
            return list(range(first, first + self.micro_batch))
        k, d = divmod(j, self.data_parallel)
        return self._batch_of(d, step * self.global_batch + k * self.micro_batch * self.data_parallel)

    def _batch_of(self, d: int, consumed: int) -> list[int]:
        """Rank ``d``'s micro-batch at ``consumed`` samples: a sampler started mid-epoch lists the rest of what one
        started at the epoch's beginning lists, so one list per epoch answers every position of it."""
        stride = self.micro_batch * self.data_parallel  # each of its micro-batches counts for every rank's
        active = len(self.dataset) - len(self.dataset) % stride  # an epoch's samples (the ragged end is dropped)
        epoch, offset = divmod(consumed, active)
        kept = self._epochs.get(d)
        if kept is None or kept.epoch != epoch:
            sampler = _random_sampler_class()(self.dataset, total_samples=len(self.dataset),
                                              consumed_samples=epoch * active, micro_batch_size=self.micro_batch,
                                              data_parallel_rank=d, data_parallel_size=self.data_parallel,
                                              data_sharding=self.data_sharding)
            kept = self._epochs[d] = _Epoch(epoch, list(sampler))  # (one shuffle, as Megatron's rank d keeps)
        return kept.batches[offset // stride]
