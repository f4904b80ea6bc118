"""Megatron-LM's rerun state machine around the plan's steps: its result validation outlives the hand-off.

Before the first failure Megatron's own ``train_step`` runs the machine (``--rerun-mode``, default
``validate_results``): the forward-backward runs in its loop, ``pretrain_gpt.py``'s loss function checks every
micro-batch's loss (NaN, Inf; a spiky loss with ``--check-for-spiky-loss``) and DDP checks each bucket's local
gradients (``check_grads``) through ``validate_result``; a rejected result makes every rank run the iteration again
in place, and the machine then goes on, or asks for a checkpoint and an exit with 16 (resume to disambiguate) or 17
(failed on result validation). After the first failure each iteration is one of the plan's steps
(``MegatronRank._train_plan_step``): the executor computes the loss from the last stage's output without the
script's loss function, and the gradients are reduced by Odyssey's per-layer sync, not DDP's buckets. So here:

- the step's forward-backward runs inside the machine's loop (:func:`runs`), as in stock ``train_step``; its
  world all-reduces go over the generation's world (the survivors);
- the script's loss function is called on the last stage's output of every micro-batch for its checks only
  (:func:`check_loss`): the loss that trains is the executor's, the same masked sum of the same output;
- the rank's gradients are checked as DDP checks a bucket (:func:`check_grads`), once reduced: with
  ``--overlap-grad-reduce`` their reductions are in flight when the backward ends, and a norm read then would race
  them (a value that differs between the run and its rerun in place). A NaN or Inf is one in the sum too;
- the machine's answer after the loop is the step's (:func:`exit_asked`): ``train()`` then saves and leaves as
  stock does, and ``clean_exit`` tells the agent the exit is Megatron's choice.

Steps trained again after a restart from a checkpoint (``MegatronRank._redo``, while Megatron's loop waits at a
later iteration) validate with the machine disabled (:func:`disabled`), as Megatron's ``evaluate`` does: a NaN or
Inf fails with Megatron's own error, since an exit there would save the model under an iteration it is not at.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch


@dataclass(frozen=True)
class RerunExit:
    """The machine ends the job in this step: ``train()`` saves a checkpoint first where ``checkpoint``, then leaves
    with ``code`` (16 or 17)."""

    checkpoint: bool
    code: int


def machine() -> Any | None:
    """Megatron's rerun state machine, or None (a megatron-core without one, or none initialised)."""
    try:
        from megatron.core import rerun_state_machine as rerun
    except ImportError:
        return None
    return rerun.get_rerun_state_machine() if getattr(rerun, "_GLOBAL_RERUN_STATE_MACHINE", None) else None


def runs(rsm: Any | None) -> Iterator[None]:
    """The step's forward-backward passes: one, or more where the machine asks to run the iteration again."""
    if rsm is None:
        yield
        return
    while rsm.should_run_forward_backward(None):  # (no data iterator to rewind: a step's batches are by its number)
        yield


def exit_asked(rsm: Any | None) -> RerunExit | None:
    """After the loop: how the machine ends the job in this step, if it does."""
    if rsm is None:
        return None
    should_checkpoint, should_exit, code = rsm.should_checkpoint_and_exit()
    return RerunExit(bool(should_checkpoint), int(code)) if should_exit else None


def _validating(rsm: Any | None) -> bool:
    """``validate_result`` may be called: inside the loop, or with the machine disabled (it then only raises)."""
    if rsm is None:
        return False
    from megatron.core.rerun_state_machine import RerunMode, RerunState

    return rsm.mode == RerunMode.DISABLED or rsm.state != RerunState.NOT_RUNNING_YET


def check_loss(loss_func: Callable[[torch.Tensor], Any], output: torch.Tensor) -> None:
    """The script's loss function on a last stage's output, for the checks it makes (its result is dropped)."""
    if _validating(machine()):
        with torch.no_grad():
            loss_func(output.detach())


def check_grads(grads: list[torch.Tensor], nan_or_inf: bool, large: bool) -> None:
    """DDP's ``check_grads`` over this rank's reduced gradients as one bucket: NaN and Inf (``--check-for-nan-in-
    loss-and-grad``, fatal) and unexpectedly large gradients (``--check-for-large-grads``, not fatal; against their
    own history, not that of DDP's per-bucket local norms before the failure, which are on another scale)."""
    rsm = machine()
    if not grads or not (nan_or_inf or large) or not _validating(rsm):
        return
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)).float())  # (one launch per dtype, as
    # clip_grad_norm_ does: the check is on by default, every step)
    grads_here = "this rank's gradients after Odyssey's data-parallel reduction"
    if nan_or_inf:
        for name, reject in (("NaN", torch.isnan), ("Inf", torch.isinf)):
            rsm.validate_result(result=norm, rejection_func=reject,
                                message=f"found {name} in the grad norm of {grads_here}", tolerance=0.001, fatal=True)
    if large:
        rsm.validate_result(result=norm, rejection_func=functools.partial(rsm.is_unexpectedly_large, threshold=10,
                                                                          context="grads after the hand-off"),
                            message=f"found unexpected large grads in {grads_here}",
                            tolerance=0.001, fatal=False)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """The machine disabled for a while (steps trained again after a restart; see the module docstring)."""
    rsm = machine()
    if rsm is None:
        yield
        return
    from megatron.core.rerun_state_machine import RerunMode

    mode = rsm.get_mode()
    rsm.set_mode(RerunMode.DISABLED)
    try:
        yield
    finally:
        rsm.set_mode(mode)


def abandon_step() -> None:
    """Back to "no step running" after a failure mid-iteration, as if the iteration had not begun: it is run again
    in the next generation. A machine left in ``INITIAL_RUN`` would take the redo for the end of the first run (and
    writes a per-rank shard of itself into every later checkpoint, keyed by the survivors' world size, which a job
    at the original size then cannot load); its iteration count would count the iteration twice, and an error it
    injected in the lost run would hold back its injection in the redo."""
    rsm = machine()
    if rsm is None:
        return
    from megatron.core.rerun_state_machine import RerunState

    if rsm.state in (RerunState.INITIAL_RUN, RerunState.RERUNNING_IN_PLACE):
        rsm.current_iteration -= 1
        injector = getattr(rsm, "error_injector", None)
        if injector is not None:
            injector.injected_error_type = None
    rsm.state = RerunState.NOT_RUNNING_YET
