"""Megatron's rerun state machine around a plan step (megatron_lm.rerun), against real megatron-core: its loop,
its rerun in place, its exit codes, the checks the script's loss function and DDP make, and a step abandoned by a
failure. One process, the session's gloo world (the machine's all-reduces run over it)."""
from __future__ import annotations

import functools
from typing import Iterator

import pytest
import torch

from megatron_odyssey.megatron_lm import rerun

core_rerun = pytest.importorskip("megatron.core.rerun_state_machine")


def _loss_func(loss_mask: torch.Tensor, output: torch.Tensor) -> tuple:
    """``pretrain_gpt.py``'s loss function, checks included (core_r0.16.0, less its argument reads)."""
    loss = torch.sum(output.view(-1).float() * loss_mask.view(-1).float())
    machine = core_rerun.get_rerun_state_machine()
    machine.validate_result(result=loss, rejection_func=torch.isnan, message="found NaN in local forward loss "
                            "calculation", tolerance=0.0, fatal=True)
    machine.validate_result(result=loss, rejection_func=torch.isinf, message="found Inf in local forward loss "
                            "calculation", tolerance=0.0, fatal=True)
    return loss, loss_mask.sum()


@pytest.fixture
def machine(gloo_world: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[callable]:
    """A fresh machine per test (``--rerun-mode``, ``--error-injection-rate``/``-type``), destroyed after it; its
    ``torch.cuda`` calls (RNG states, flag tensors) on the CPU, as the Megatron-LM CPU mode points them."""
    from megatron_odyssey.megatron_lm.cpu_mode import _CORE_TORCH_VIEW

    monkeypatch.setattr(core_rerun, "torch", _CORE_TORCH_VIEW)

    def make(mode: str = "validate_results", rate: int = 0, kind: str = "transient_error"):
        core_rerun.initialize_rerun_state_machine(
            mode=core_rerun.RerunMode(mode),
            error_injector=core_rerun.RerunErrorInjector(error_injection_rate=rate,
                                                         error_injection_type=core_rerun.RerunDiagnostic(kind)))
        return core_rerun.get_rerun_state_machine()

    yield make
    core_rerun.destroy_rerun_state_machine()


def _step(loss: float, grad: float = 1.0) -> tuple[int, rerun.RerunExit | None]:
    """One plan step as ``MegatronRank._train_plan_step`` runs it: the forward-backward passes the machine asks
    for (each checks a last stage's loss and the local gradients), then its decision."""
    rsm = rerun.machine()
    passes = 0
    for _ in rerun.runs(rsm):
        passes += 1
        rerun.check_loss(functools.partial(_loss_func, torch.ones(4)), torch.full((4,), loss))
        rerun.check_grads([torch.full((3,), grad)], nan_or_inf=True, large=False)
    return passes, rerun.exit_asked(rsm)


def test_clean_steps_run_once_and_go_on(machine) -> None:
    rsm = machine()
    assert [_step(1.0) for _ in range(3)] == [(1, None)] * 3
    assert rsm.current_iteration == 2  # counted from -1, one per step, as stock train_step counts


@pytest.mark.parametrize("kind, code", [("transient_error", 17), ("persistent_error", 16), ("correct_result", 16)])
def test_a_rejected_result_is_run_again_in_place_and_ends_the_job_as_stock(machine, kind: str, code: int) -> None:
    """Megatron's own error injection (every validation rejected from the second iteration on): the step runs
    twice, then the machine asks for a checkpoint and exit 17 (not reproducible: a transient fault) or 16 (resume
    on another device to tell)."""
    machine(rate=1, kind=kind)
    assert _step(1.0) == (1, None)  # (the first iteration is never validated: no checkpoint could be taken)
    assert _step(1.0) == (2, rerun.RerunExit(checkpoint=True, code=code))
    assert code in rerun_exit_codes()


def rerun_exit_codes() -> set[int]:
    return {core_rerun.EXIT_CODE_RESUME_TO_DISAMBIGUATE, core_rerun.EXIT_CODE_FAILED_ON_RESULT_VALIDATION}


@pytest.mark.parametrize("loss, grad", [(float("nan"), 1.0), (1.0, float("inf"))], ids=["NaN loss", "Inf grads"])
def test_a_real_nan_or_inf_is_caught_in_the_loss_or_the_gradients(machine, loss: float, grad: float) -> None:
    """Reproducible in place (the same NaN), so the machine asks to resume elsewhere: exit 16 after a save."""
    machine()
    assert _step(1.0) == (1, None)
    assert _step(loss, grad) == (2, rerun.RerunExit(checkpoint=True, code=16))


def test_checks_outside_a_step_are_skipped_not_asserted(machine) -> None:
    """The stage runner's forward outside a plan step (nothing validates there): no assertion from the machine."""
    machine()
    rerun.check_loss(functools.partial(_loss_func, torch.ones(4)), torch.full((4,), float("nan")))
    rerun.check_grads([torch.full((3,), float("nan"))], nan_or_inf=True, large=False)


def test_a_step_abandoned_by_a_failure_is_run_as_if_it_had_not_begun(machine) -> None:
    """A failure inside the step (here: after the injected rejection, before the machine's decision): the redo
    counts the iteration once and injects again, so it ends as the uninterrupted step would have."""
    rsm = machine(rate=1)
    assert _step(1.0) == (1, None)
    runs = rerun.runs(rerun.machine())
    next(runs)
    rerun.check_loss(functools.partial(_loss_func, torch.ones(4)), torch.full((4,), 1.0))  # rejected: injected
    assert rsm.rerun_requested and rsm.current_iteration == 1
    rerun.abandon_step()
    assert rsm.state == core_rerun.RerunState.NOT_RUNNING_YET and rsm.current_iteration == 0
    assert _step(1.0) == (2, rerun.RerunExit(checkpoint=True, code=17))
    assert rsm.current_iteration == 1


def test_steps_trained_again_after_a_restart_validate_with_the_machine_disabled(machine) -> None:
    """No rerun and no exit there (Megatron's loop is at a later iteration): a NaN fails with Megatron's error."""
    rsm = machine()
    assert _step(1.0) == (1, None)
    with rerun.disabled():
        assert _step(1.0) == (1, None)
        with pytest.raises(RuntimeError, match="found NaN in local forward loss calculation"):
            _step(float("nan"))
    assert rsm.get_mode() == core_rerun.RerunMode.VALIDATE_RESULTS



def test_the_gradient_checks_say_what_they_found(machine, caplog: pytest.LogCaptureFixture) -> None:
    """Where the machine does not rerun (disabled), a rejected gradient norm fails or warns with its message: an Inf
    (fatal), and gradients over 10x the largest of the norms seen before (--check-for-large-grads, a warning)."""
    import logging

    machine()
    assert _step(1.0) == (1, None)
    here = "this rank's gradients after Odyssey's data-parallel reduction"
    with rerun.disabled():
        with pytest.raises(RuntimeError, match=f"found Inf in the grad norm of {here}"):
            rerun.check_grads([torch.full((3,), float("inf"))], nan_or_inf=True, large=False)
        with caplog.at_level(logging.WARNING):
            for _ in range(101):  # the machine's sample of norms before it judges one
                rerun.check_grads([torch.full((3,), 1.0)], nan_or_inf=False, large=True)
            assert not any("large grads" in r.getMessage() for r in caplog.records)
            rerun.check_grads([torch.full((3,), 1000.0)], nan_or_inf=False, large=True)
    assert f"found unexpected large grads in {here}" in caplog.text

def test_without_a_machine_a_step_runs_once() -> None:
    assert len(list(rerun.runs(None))) == 1 and rerun.exit_asked(None) is None
