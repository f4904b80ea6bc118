"""Megatron's growing global batch with ``--odyssey``: ``--rampup-batch-size`` (core_r0.12 to core_r0.17) and
``--step-batch-size-schedule`` (core_r0.18 on, which replaced it: those releases accept the old flag and ignore it,
and so does this module, asking their own calculator).

Every plan splits one fixed global batch into micro-batches, so a failure is recovered in-process only once the
schedule has reached its final batch. Before that ("the ramp") Megatron runs as it is, and a failure stops the
job with the checkpoint to relaunch from: the job's own command line then loads it and ramps on, as stock
Megatron-LM would (``runtime.agent``; so does an in-process restart that would have to go back into the ramp, and
a slow node found inside the ramp is named but not acted on).
Megatron's own GPT-3 175B example (``--rampup-batch-size 16 16 5859375``, DP=16) reaches its batch of 1536 at
iteration 19,803 of 500,000: 96% of the run is recoverable in-process.

Where the ramp ends is Megatron's own calculator's answer for the job's arguments, stepped iteration by
iteration (:func:`megatron_batch_ramp`): iteration ``s`` past it starts at sample ``ramp_samples + (s -
ramp_end) * global_batch``, which the plan's data reads (``samples.GlobalMicroBatches``) and a joining rank's
loop counters start from.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

#: a ramp longer than this many iterations is taken for a schedule that never reaches its final batch
_MAX_RAMP_ITERATIONS = 10_000_000


@dataclass(frozen=True)
class BatchRamp:
    """The iteration from which Megatron's batch-size schedule is at its final ``global_batch`` (its running
    size: rounded down to micro-batch x data-parallel size with ``--decrease-batch-size-if-needed``), and the
    samples consumed before it."""

    ramp_end: int
    ramp_samples: int
    global_batch: int

    def samples_before(self, step: int) -> int:
        """Samples Megatron consumed before iteration ``step`` (0-based), past the ramp."""
        if step < self.ramp_end:
            raise ValueError(f"iteration {step + 1} is inside the batch-size ramp, which ends at iteration "
                             f"{self.ramp_end + 1}: its global batch is not {self.global_batch}")
        return self.ramp_samples + (step - self.ramp_end) * self.global_batch

    def to_list(self) -> list[int]:
        return [self.ramp_end, self.ramp_samples, self.global_batch]

    @classmethod
    def from_list(cls, value: list[int] | None) -> "BatchRamp | None":
        return cls(*(int(v) for v in value)) if value else None


def has_batch_schedule(args: Any) -> bool:
    return bool(getattr(args, "rampup_batch_size", None) or getattr(args, "step_batch_size_schedule", None))


def megatron_batch_ramp(args: Any) -> BatchRamp | None:
    """Megatron's own micro-batch calculator for the job's arguments (built as ``global_vars`` builds it, its
    arguments by name: the function's signature differs between releases), stepped to its final batch; None
    for a constant global batch."""
    if not has_batch_schedule(args):
        return None
    from megatron.core import num_microbatches_calculator as nmc

    dp = int(args.data_parallel_size) * int(getattr(args, "gtp_weight_remat_size", 1) or 1)
    known = {"rank": 1,  # (not 0: the probe logs nothing)
             "rampup_batch_size": getattr(args, "rampup_batch_size", None),
             "global_batch_size": args.global_batch_size, "micro_batch_size": args.micro_batch_size,
             "data_parallel_size": dp,
             "decrease_batch_size_if_needed": bool(getattr(args, "decrease_batch_size_if_needed", False)),
             "step_batch_size_schedule": getattr(args, "step_batch_size_schedule", None),
             "seq_length": getattr(args, "seq_length", None)}
    build = nmc._build_num_microbatches_calculator
    calc = build(**{k: v for k, v in known.items() if k in inspect.signature(build).parameters})
    if isinstance(calc, nmc.ConstantNumMicroBatchesCalculator):  # core_r0.18.0 on ignore --rampup-batch-size
        return None
    final, consumed, step = calc.global_batch_size, 0, 0
    while True:
        calc.update(consumed, consistency_check=False)
        if calc.get_current_global_batch_size() == final:
            return BatchRamp(step, consumed, calc.get_current_running_global_batch_size())
        consumed += calc.get_current_running_global_batch_size()
        step += 1
        if step > _MAX_RAMP_ITERATIONS:
            raise ValueError(f"Megatron's batch-size schedule does not reach its final global batch {final} within "
                             f"{_MAX_RAMP_ITERATIONS} iterations")
