"""Fault injection for tests and demos: ``--fail step=5,rank=3,phase=backward,kind=kill``.

``kill`` sends SIGKILL to the rank's own (real) process, ``hang`` SIGSTOP (the agent's heartbeat
check must catch and fence it), ``stall`` stops the main thread inside a collective no peer joins (as a
hung kernel or a lost message would: the process and its heartbeat thread live on, so only the agent's
progress check can catch it), ``slow`` sleeps (a straggler that must *not* be declared dead),
``error`` raises :class:`InjectedError` from the injection point: a local bug of the rank (as an
out-of-memory or a shape error would be), which it must report and leave the job for, not take
for a peer's failure. ``kill-agent`` SIGKILLs the rank's agent (its parent: the agent of ``odyssey
train``, the launcher of machine 0 under ``odyssey-launch``) and goes on; ``kill-with-agent`` kills the
agent and the rank itself (a lost machine that held both): the standby agent must take over;
``kill-machine`` (``odyssey-launch`` only) kills the rank's launcher and every rank it started: the
whole machine is lost (on machine 0, with the agent).
The rank records when it fired in the store, so the agent can report detection latency.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from ..planning.errors import PlanningError

#: the moments of a step (and around it) a fault can hit: inside the step (forward, backward, grad-sync,
#: optimizer, data: fetching a micro-batch), while recovering, and between steps (log: Megatron's
#: training_log; save: a checkpoint save; between: just after a step, before anything else)
PHASES = ("forward", "backward", "weight-grad", "grad-sync", "optimizer", "data", "recovery", "log", "save", "between")
KINDS = ("kill", "hang", "stall", "slow", "error", "kill-agent", "kill-with-agent", "kill-machine")
SLOW_S = 2.0


class InjectedError(RuntimeError):
    """``kind=error``: a plain exception, as a real bug in the rank's own code would raise."""


@dataclass(frozen=True)
class FailSpec:
    step: int
    rank: int  # launch-time global rank (node * TP + tp_rank)
    phase: str = "forward"
    kind: str = "kill"

    @classmethod
    def parse(cls, text: str) -> "FailSpec":
        fields: dict[str, str] = {}
        for part in text.split(","):
            if "=" not in part:
                raise PlanningError(f"--fail {text!r}: expected key=value pairs like step=5,rank=3,phase=backward,kind=kill")
            key, value = (x.strip() for x in part.split("=", 1))
            fields[key] = value
        unknown = set(fields) - {"step", "rank", "phase", "kind"}
        if unknown:
            raise PlanningError(f"--fail {text!r}: unknown key(s) {sorted(unknown)}; use step, rank, phase, kind")
        try:
            spec = cls(int(fields["step"]), int(fields["rank"]), fields.get("phase", "forward"), fields.get("kind", "kill"))
        except KeyError as missing:
            raise PlanningError(f"--fail {text!r}: missing {missing.args[0]}") from None
        except ValueError:
            raise PlanningError(f"--fail {text!r}: step and rank must be integers") from None
        if spec.phase not in PHASES:
            raise PlanningError(f"--fail {text!r}: phase must be one of {PHASES}")
        if spec.kind not in KINDS:
            raise PlanningError(f"--fail {text!r}: kind must be one of {KINDS}")
        if spec.step < 0 or spec.rank < 0:
            raise PlanningError(f"--fail {text!r}: step and rank must be >= 0")
        return spec


class Injector:
    """Fires this rank's fault specs when the training loop reaches their step and phase."""

    def __init__(self, specs: list[FailSpec], ident: int, store=None):
        self.specs = [s for s in specs if s.rank == ident]
        self.ident = ident
        self.store = store
        self.fired: set[FailSpec] = set()

    def __call__(self, step: int, phase: str) -> None:
        for spec in self.specs:
            if spec in self.fired or spec.step != step or spec.phase != phase:
                continue
            self.fired.add(spec)
            if self.store is not None:
                self.store.set(f"odyssey/injected/{self.ident}", repr(time.time()))
            if spec.kind == "kill-machine":
                _kill_machine()
            if spec.kind in ("kill-agent", "kill-with-agent"):
                os.kill(os.getppid(), signal.SIGKILL)
            if spec.kind in ("kill", "kill-with-agent"):
                if os.getpgid(0) == os.getpid():  # a launched rank leads its group: take its workers too
                    os.killpg(os.getpid(), signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
            elif spec.kind == "hang":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif spec.kind == "stall":
                _stall_in_a_collective()
            elif spec.kind == "error":
                raise InjectedError(f"injected error (--fail step={step},rank={self.ident},phase={phase},kind=error)")
            elif spec.kind == "slow":
                time.sleep(SLOW_S)


def _kill_machine() -> None:
    """SIGKILL this rank's launcher and every rank it started (each leads its own process group), then
    this rank: what a machine's power loss does."""
    launcher = os.getppid()
    siblings = []
    for task in os.listdir(f"/proc/{launcher}/task"):
        try:
            with open(f"/proc/{launcher}/task/{task}/children") as f:
                siblings += [int(pid) for pid in f.read().split()]
        except OSError:
            pass
    os.kill(launcher, signal.SIGKILL)
    for pid in siblings:
        if pid != os.getpid():
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    if os.getpgid(0) == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _stall_in_a_collective() -> None:
    """Enter a barrier over the world that no peer enters, and stay stopped if it ever returns."""
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.barrier()
    except Exception:  # the world was torn down around us (peers recovered): stay stalled all the same
        pass
    while True:
        time.sleep(3600)
