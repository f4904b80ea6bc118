"""A Megatron-LM job that trained to its end leaves with its own exit code, not SIGABRT.

Megatron never destroys its process groups: they go with the interpreter. A gloo group's worker thread can still
hold a finished collective (its tensors) when the main thread shuts the interpreter down; dropping those tensors
then takes the GIL from a dying interpreter, and the process aborts with "terminate called without an active
exception" (pytorch/pytorch#190489; the core dump's aborting thread is in ``ProcessGroupGloo::runLoop``, destroying
an ``AsyncAllgatherWork``). A 4-rank gloo script whose last call is an all-gather aborts in 6 of 10 runs here; the
tiny CPU Megatron-LM job with evaluation, whose last collective is the evaluate timer's all-gather, in about 1 of
15. Under ``odyssey-launch`` such a rank is a failure after the last step, so a job that trained to its end
exited 1. Megatron on GPUs has gloo groups too (``--enable-gloo-process-groups``, the distributed optimizer's
checkpoint gathers).

So when ``pretrain()`` returns, or leaves through ``sys.exit`` with 0 (Megatron's exit checks) or with a code of
Megatron's rerun state machine (:func:`chosen_exits`: every rank leaves with it, after the save it asks for),
the process groups are destroyed while the interpreter is whole. Never after an error: a peer may still be inside
a collective with this rank. Never under ``--inprocess-restart``, whose wrapper owns the groups' lifetime. Bounded:
a teardown that does not end within :data:`TEARDOWN_LIMIT_S` leaves the process with the exit code it was leaving
with.

An ``--odyssey`` rank leaving with such a code first tells the agent (``control_plane.LEAVING_KEY``): the exit is
the job's end, chosen by Megatron, not a failure to recover from, and the job leaves with that code.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from typing import Any, Callable, ContextManager

TEARDOWN_LIMIT_S = 30.0


def _wanted() -> bool:
    """With ``--odyssey``, and in the CPU mode (stock Megatron-LM on gloo alone, the tests' reference)."""
    from megatron.training import get_args

    from .cpu_mode import megatron_lm_cpu_mode_enabled

    try:
        args = get_args()
    except Exception:  # noqa: BLE001 - pretrain() left before parsing its arguments
        return False
    if getattr(args, "inprocess_restart", False):
        return False
    return bool(getattr(args, "odyssey", False)) or megatron_lm_cpu_mode_enabled()


def chosen_exits() -> dict[int, str]:
    """The codes Megatron-LM's ``train()`` leaves with by its own decision, on every rank at once (its rerun state
    machine's, after the checkpoint it asks for, where it asks for one), and what each means."""
    try:
        from megatron.core import rerun_state_machine as rerun
    except ImportError:  # megatron-core without the rerun machine
        return {}
    meanings = {"EXIT_CODE_RESUME_TO_DISAMBIGUATE": "Megatron-LM's rerun state machine asks to resume the job from "
                "its last checkpoint, to tell a transient fault from a faulty device",
                "EXIT_CODE_FAILED_ON_RESULT_VALIDATION": "Megatron-LM's rerun state machine found a result that "
                "failed its validation (NaN, Inf or a spiky loss) and ended the job"}
    return {getattr(rerun, name): meaning for name, meaning in meanings.items() if hasattr(rerun, name)}


def destroy_groups(limit_s: float = TEARDOWN_LIMIT_S, lock: ContextManager[Any] | None = None, code: int = 0) -> None:
    """Destroy every process group now (holding ``lock``: an ``--odyssey`` rank's abort watcher may be aborting
    them); past ``limit_s`` leave with ``code``, the one of the end it is called at, instead of waiting on."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return

    def too_long() -> None:
        print(f"odyssey: the process groups did not shut down within {limit_s:.0f} s after the job ended; "
              f"leaving without them (exit code {code})", file=sys.stderr, flush=True)
        os._exit(code)

    watchdog = threading.Timer(limit_s, too_long)
    watchdog.daemon = True
    watchdog.start()
    try:
        with lock or contextlib.nullcontext():
            dist.destroy_process_group()
    finally:
        watchdog.cancel()


def _generation_lock() -> ContextManager[Any] | None:
    from . import hooks

    runtime = hooks.STATE.runtime
    return getattr(runtime, "gen_lock", None)


def say_leaving(code: int, why: str) -> None:
    """Tell the agent, before leaving, that this exit code is the script's choice (an ``--odyssey`` rank only)."""
    from ..runtime import control_plane
    from . import hooks

    runtime = hooks.STATE.runtime
    if getattr(runtime, "store", None) is not None:
        control_plane.say_leaving(runtime.store, runtime.ident, code, why)


def say_done() -> None:
    """Tell the agent this rank finished the job (an ``--odyssey`` rank only), before the teardown: destroying a
    group can block in C++ with the GIL held (its heartbeat thread then stops too), and a rank that said it is done
    and goes silent is shutting down, not hung (the agent kills it at its hard timeout, and the job still ends
    with 0: its work is done)."""
    from . import hooks

    runtime = hooks.STATE.runtime
    if hasattr(runtime, "say_done"):
        runtime.say_done()


def leave_with_groups_destroyed(original: Callable[..., Any], wanted: Callable[[], bool] = _wanted,
                                lock: Callable[[], ContextManager[Any] | None] = _generation_lock,
                                chosen: Callable[[], dict[int, str]] = chosen_exits,
                                done: Callable[[], None] = say_done) -> Callable[..., Any]:
    """Wraps ``megatron.training.pretrain`` (``wanted``, ``lock``: whether to, and what to hold meanwhile;
    ``chosen``: the non-zero codes it leaves with by its own decision, and their meaning; ``done``: says, on a
    clean end, that the job's work is done, before the teardown)."""

    @functools.wraps(original)
    def pretrain(*args: Any, **kwargs: Any) -> Any:
        try:
            out = original(*args, **kwargs)
        except SystemExit as leaving:
            code = leaving.code or 0
            why = chosen().get(code) if isinstance(code, int) and code else None
            if (code == 0 or why is not None) and wanted():  # (asked last: it reads Megatron's arguments)
                if why is not None:
                    say_leaving(code, why)
                else:
                    done()
                destroy_groups(lock=lock(), code=code)
            raise
        if wanted():
            done()
            destroy_groups(lock=lock())
        return out

    return pretrain
