"""Evaluation during training (``--eval-iters``, ``--eval-interval``, the final validation and test passes) in
any layout.

Before the first failure Megatron evaluates as it always does: its forward-only schedule over each rank's own
validation iterator. After it, ``evaluate`` still runs as written, but its call of the schedule function
reaches the dispatcher's ``PlanSchedule`` with ``forward_only``, which runs the current plan's forward
operations (:meth:`~megatron_odyssey.runtime.executor.PipelineExecutor.run_forward_only`) over the evaluation
batch: global micro-batch ``j`` holds the samples Megatron's sampler gives data-parallel rank ``j % DP`` (of
generation 0) at the split's current position (``samples.GlobalMicroBatches``), whichever pipeline runs it.

Every rank then gets the evaluation batch's ``[loss sum, tokens]`` pairs and answers with the loss dictionaries
that make ``evaluate``'s own arithmetic give stock's figure. Under our parallel_state every rank is the last
pipeline stage of a data-parallel world of one, so ``evaluate``'s reduction over data-parallel ranks does
nothing; what stock spreads over its ranks is summed here in stock's order (:func:`stock_loss_dicts`).

An evaluation is watched like a step: its start and each micro-batch's forward mark progress (phase ``eval``;
the forward is also where ``--odyssey-inject-fault ...,phase=eval`` fires), so a rank that stops inside it while
its heartbeat goes on is named and fenced after the soft and hard timeouts; the rank is at rest again when
``evaluate`` returns.
A failure during an evaluation (stock's, or one of ours) is recovered from like any between iterations
(``between_steps``); the survivors then run the whole evaluation again, in the new layout, from the position it
began at. Where a split's position comes from: the validation split's is Megatron's own
``args.consumed_valid_samples`` (which ``evaluate`` advances per iteration); the test split's sampler starts
at 0 in every process, so its position is kept here (``evaluate`` advances ``consumed_valid_samples`` for it
too, which gives the count).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..runtime.liveness import COMM, IDLE
from .between_steps import guarded
from .hooks import STATE, loss_reduction_as_communication

LOSS_KEY = "lm loss"  # pretrain_gpt.py's loss_func reports under this key


def stock_loss_dicts(pairs: torch.Tensor, data_parallel: int, per_micro_batch: bool) -> list[dict[str, Any]]:
    """What this rank's schedule returns to ``evaluate`` for one evaluation iteration, given every global
    micro-batch's fp32 ``[loss sum, tokens]`` (row ``j``; rank ``j % data_parallel``'s ``j // data_parallel``-th):

    - ``per_micro_batch`` (core_r0.12): its ``loss_func`` all-reduces each micro-batch's pair over the
      data-parallel ranks and ``evaluate`` adds the reduced pairs up one micro-batch at a time: one dictionary
      per micro-batch of a rank, each holding the ranks' sum (a tuple, as that ``loss_func`` reports it);
    - else (core_r0.13 on): each rank stacks its pairs and sums them, then the ranks all-reduce, and
      ``evaluate`` adds that: one dictionary with the total.

    The ranks' sum is taken in rank order (gloo's, for two ranks, is the same single addition)."""
    micro_batches = pairs.shape[0]
    if micro_batches % data_parallel:
        raise ValueError(f"{micro_batches} micro-batches do not split over {data_parallel} data-parallel ranks")
    per_rank = micro_batches // data_parallel
    if per_micro_batch:
        out = []
        for k in range(per_rank):
            total = pairs[k * data_parallel].clone()
            for d in range(1, data_parallel):
                total = total + pairs[k * data_parallel + d]
            out.append({LOSS_KEY: (total[0], total[1])})
        return out
    total = None
    for d in range(data_parallel):
        rank_sum = torch.vstack([pairs[k * data_parallel + d] for k in range(per_rank)]).sum(dim=0)
        total = rank_sum if total is None else total + rank_sum
    return [{LOSS_KEY: total}]


@dataclass
class EvalSplits:
    """Which split each of Megatron's evaluation iterators reads, and where the one being evaluated is."""

    kinds: dict[int, str] = field(default_factory=dict)  # id(iterator) -> "valid" | "test"
    test_consumed: int = 0  # samples the test split's samplers have handed out
    current: str | None = None  # the split of the evaluation running now
    valid_at_start: int = 0  # args.consumed_valid_samples when it began

    def record(self, iterators: Any, kind: str) -> None:
        for it in iterators if isinstance(iterators, (list, tuple)) else [iterators]:
            if it is not None:
                self.kinds[id(it)] = kind

    def lookup(self, data_iterator: Any) -> str | None:
        first = data_iterator[0] if isinstance(data_iterator, (list, tuple)) and data_iterator else data_iterator
        return self.kinds.get(id(first))

    def kind_of(self, data_iterator: Any) -> str:
        kind = self.lookup(data_iterator)
        if kind is None:
            raise RuntimeError("Odyssey evaluates after a failure only over the validation and test iterators that "
                               "Megatron's build_train_valid_test_data_iterators made; this evaluate() was given "
                               "another one")
        return kind

    def position(self, args: Any) -> int:
        """Samples of the current split read before this evaluation iteration (as every rank's sampler counts)."""
        if self.current == "test":
            return self.test_consumed + int(args.consumed_valid_samples) - self.valid_at_start
        return int(args.consumed_valid_samples)


EVAL = EvalSplits()


def capture_eval_iterators(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron's ``build_train_valid_test_data_iterators``: unchanged, but remembers which iterator is the
    validation split's and which the test split's (``evaluate`` is given one or the other)."""

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        EVAL.record(out[1], "valid")
        EVAL.record(out[2], "test")
        return out

    return wrapper


def _keep_evaluation_state(*args: Any, **kwargs: Any) -> Callable[[], None]:
    """What an interrupted ``evaluate`` leaves changed: the validation count it advanced per iteration and the
    rerun state machine's mode (set to DISABLED for the evaluation, put back only at its end)."""
    from megatron.training.global_vars import get_args

    margs = get_args()
    consumed = margs.consumed_valid_samples
    machine = _rerun_machine()
    mode = machine.get_mode() if machine is not None else None

    def restore() -> None:
        margs.consumed_valid_samples = consumed
        if machine is not None:
            machine.set_mode(mode)

    return restore


def _rerun_machine() -> Any:
    try:
        from megatron.core.rerun_state_machine import get_rerun_state_machine
    except ImportError:  # a megatron-core without it
        return None
    return get_rerun_state_machine()


_guarded_evaluate = guarded("eval", "the evaluation", keep=_keep_evaluation_state, at_rest=False)


def _watched(runtime: Any, forward_step_func: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron's forward step, marking progress (and the ``eval`` injection point) before each micro-batch:
    in stock's forward-only schedule before the first failure, in ``PlanSchedule``'s after it."""

    reduced_per_micro_batch = bool(runtime.cfg.extra.get("loss_reduced_per_micro_batch"))

    @functools.wraps(forward_step_func)
    def forward_step(*args: Any, **kwargs: Any) -> Any:
        runtime.at(runtime.committed, "eval")
        return loss_reduction_as_communication(forward_step_func(*args, **kwargs), reduced_per_micro_batch)

    return forward_step


def awaiting_the_losses_of_the_data_parallel_peers(runtime: Any) -> None:
    """After an evaluation iteration's schedule, until the next one's first forward marks progress: from
    core_r0.19.0 on ``evaluate()`` all-reduces each iteration's loss sums over the data-parallel group there, so a
    last stage whose replica stopped inside its forward waits in it. That rank waits on a peer; left marked as
    working since its own last forward, it stopped after the stalled replica only by the length of one forward, and
    on a loaded machine the agent fenced it first (a healthy rank lost, and with it the stage)."""
    runtime.progress.set_state(COMM)


def evaluate(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron's ``evaluate``: run as it is (its schedule call reaches ``PlanSchedule`` after a failure),
    redone in the new layout when a failure interrupts it, and the test split's position kept."""
    guarded_original = _guarded_evaluate(original)

    @functools.wraps(original)
    def wrapper(forward_step_func: Any, data_iterator: Any, *args: Any, **kwargs: Any) -> Any:
        if STATE.runtime is None:
            return original(forward_step_func, data_iterator, *args, **kwargs)
        from megatron.training.global_vars import get_args

        margs = get_args()
        # (an iterator of the script's own is fine before a failure: stock evaluates it; after one it is refused)
        EVAL.current, EVAL.valid_at_start = EVAL.lookup(data_iterator), int(margs.consumed_valid_samples)
        # inside the evaluation from here on (no injection point): a later stage's first act is to receive its
        # input, before its first forward marks anything, and a rank waiting there must not look parked at the
        # last stop (the agent judges nobody by progress while a rank is at rest)
        STATE.runtime.progress.mark(STATE.runtime.committed, "eval")
        try:
            return guarded_original(_watched(STATE.runtime, forward_step_func), data_iterator, *args, **kwargs)
        finally:
            STATE.runtime.progress.set_state(IDLE)  # at rest again (Megatron's logging follows)
            if EVAL.current == "test":
                EVAL.test_consumed += int(margs.consumed_valid_samples) - EVAL.valid_at_start
            EVAL.current = None

    return wrapper
