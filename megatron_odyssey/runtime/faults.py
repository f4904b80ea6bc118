"""Fault injection for tests and demos: ``--fail step=5,rank=3,phase=backward,kind=kill``.

``kill`` sends SIGKILL to the rank's own (real) process, ``hang`` SIGSTOP (the agent's heartbeat
check must catch and fence it), ``stall`` stops the main thread inside a collective no peer joins (as a
hung kernel or a lost message would: the process and its heartbeat thread live on, so only the agent's
progress check can catch it), ``block`` stops the main thread in its own work, outside any collective (as a
write to a hung file system or to a full terminal pipe would: the process and its heartbeat live on, and its peers
wait for it in their next collective), ``slow`` sleeps 2 s once (a straggler that must *not* be declared dead), or,
with ``factor=F``, makes every compute operation of the rank take F times as long from that step on (a
sustained fail-slow node, which the agent's diagnosis must name and the planner handle); ``slow-link`` with
``factor=F`` holds each message the rank sends back for (F - 1) times the fastest compute it has timed (a slow
link: its compute is normal, its receivers wait),
``error`` raises :class:`InjectedError` from the injection point: a local bug of the rank (as an
out-of-memory or a shape error would be), which it must report and leave the job for, not take
for a peer's failure. ``crash`` makes the rank segfault in native code (``faulthandler._sigsegv``: as a bug in
a kernel library or a driver would), so the process dies of SIGSEGV with the Python stacks faulthandler dumps in
its log, which the agent shows on the terminal. ``kill-agent`` SIGKILLs the rank's agent (its parent: the agent
of ``odyssey train``, the launcher of machine 0 under ``odyssey-launch``) and goes on; ``kill-with-agent`` kills the
agent and the rank itself (a lost machine that held both): the standby agent must take over;
``exit`` with ``code=C`` is no fault: the training script ends the job with a code of its own, as Megatron-LM's
rerun state machine does on every rank at once (16: resume to disambiguate, 17: a result failed validation); the
rank tells the agent (``control_plane.say_leaving``) and leaves with C, and the job must end with C, not recover;
``sigterm`` is no fault either: the rank's own process gets SIGTERM, as from a scheduler that signals every task
itself (not through ``odyssey-launch``): with Megatron-LM's ``--exit-signal-handler`` every rank saves and leaves
after that iteration (its exit check gathers the flag over the world), an end the agent cannot know ahead;
``deadline`` (Megatron-LM only) is no fault either: the job's wall-clock limit (``--exit-duration-in-mins``) is
reached at that step, as a scheduler's time limit would be (the rank's clock of the job's start is set back by the
limit): the exit check after that iteration all-reduces an elapsed time past it, and every rank saves and leaves,
an end the agent cannot know ahead either, at a step a test can choose;
``kill-machine`` (``odyssey-launch`` only) kills the rank's launcher and every rank it started: the
whole machine is lost (on machine 0, with the agent); ``kill-writer`` (``phase=save``, Megatron-LM only): every
process the rank forks from then on (the save's checkpoint writers) is SIGKILLed as it starts, as by the OOM killer
(the save would wait for them forever: ``liveness.SaveWriters``).
The rank records when it fired in the store, so the agent can report detection latency.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass, replace

from ..planning.errors import PlanningError

#: the moments of a step (and around it) a fault can hit: inside the step (forward, backward, grad-sync,
#: optimizer, data: fetching a micro-batch), while recovering, and between steps (log: Megatron's
#: training_log; save: a checkpoint save; between: just after a step, before anything else; eval: at the
#: forward of an evaluation's micro-batch, after that step; exit: at Megatron's exit check after that step,
#: checkpoint_and_decide_exit, whose --exit-signal-handler / --exit-duration-in-mins collectives span the world; end:
#: after the last step: at the first guarded call train() makes once its loop has ended (--log-energy's closing lap, or,
#: on an exit by --exit-interval & co, 0.18+'s barrier before sys.exit), else at pretrain's world barrier once train()
#: has returned, before its final save and validation; inside: once the rank has told the agent it is inside the step
#: a waiting drop of a slow node named (drop_gate), at that step: fires only while a drop waits)
PHASES = ("forward", "backward", "weight-grad", "grad-sync", "optimizer", "data", "recovery", "log", "save", "between",
          "eval", "exit", "end", "inside")
KINDS = ("kill", "hang", "stall", "block", "slow", "slow-link", "error", "crash", "kill-agent", "kill-with-agent",
         "kill-machine", "exit", "kill-writer", "sigterm", "deadline")
SUSTAINED = ("slow", "slow-link")  # kinds that take factor=F and last from their step on
SLOW_S = 2.0


class InjectedError(RuntimeError):
    """``kind=error``: a plain exception, as a real bug in the rank's own code would raise."""


@dataclass(frozen=True)
class FailSpec:
    step: int
    rank: int  # launch-time global rank (node * TP + tp_rank)
    phase: str = "forward"
    kind: str = "kill"
    factor: float = 0.0  # slow, slow-link: the sustained slowdown (0: slow is a one-off 2 s sleep)
    steps: int = 0  # slow, slow-link with factor: how many steps it lasts (0: to the end of the job)
    code: int = 0  # exit: the exit code the script leaves with

    @classmethod
    def parse(cls, text: str) -> "FailSpec":
        fields: dict[str, str] = {}
        for part in text.split(","):
            if "=" not in part:
                raise PlanningError(f"--fail {text!r}: expected key=value pairs like step=5,rank=3,phase=backward,kind=kill")
            key, value = (x.strip() for x in part.split("=", 1))
            fields[key] = value
        unknown = set(fields) - {"step", "rank", "phase", "kind", "factor", "steps", "code"}
        if unknown:
            raise PlanningError(f"--fail {text!r}: unknown key(s) {sorted(unknown)}; use step, rank, phase, kind, "
                                f"factor, steps, code")
        try:
            spec = cls(int(fields["step"]), int(fields["rank"]), fields.get("phase", "forward"), fields.get("kind", "kill"))
        except KeyError as missing:
            raise PlanningError(f"--fail {text!r}: missing {missing.args[0]}") from None
        except ValueError:
            raise PlanningError(f"--fail {text!r}: step and rank must be integers") from None
        if "factor" in fields:
            if spec.kind not in SUSTAINED:
                raise PlanningError(f"--fail {text!r}: factor= applies to kind {' or '.join(SUSTAINED)} only")
            try:
                factor = float(fields["factor"])
            except ValueError:
                raise PlanningError(f"--fail {text!r}: factor must be a number > 1, got {fields['factor']!r}") from None
            if not factor > 1.0 or factor != factor or factor == float("inf"):
                raise PlanningError(f"--fail {text!r}: factor must be a number > 1 (how many times slower), "
                                    f"got {fields['factor']}")
            spec = replace(spec, factor=factor)
        elif spec.kind == "slow-link":
            raise PlanningError(f"--fail {text!r}: kind=slow-link needs factor=F (F > 1)")
        if "steps" in fields:
            if not spec.factor:
                raise PlanningError(f"--fail {text!r}: steps= applies to a sustained slowdown (kind=slow or "
                                    f"slow-link with factor=F) only")
            if not fields["steps"].isdigit() or int(fields["steps"]) < 1:
                raise PlanningError(f"--fail {text!r}: steps must be an integer >= 1, got {fields['steps']!r}")
            spec = replace(spec, steps=int(fields["steps"]))
        if "code" in fields or spec.kind == "exit":
            if spec.kind != "exit":
                raise PlanningError(f"--fail {text!r}: code= applies to kind=exit only")
            code = fields.get("code", "")
            if not code.isdigit() or not 1 <= int(code) <= 255:
                raise PlanningError(f"--fail {text!r}: kind=exit needs code=C, an exit code from 1 to 255")
            spec = replace(spec, code=int(code))
        if spec.kind == "kill-writer" and spec.phase != "save":
            raise PlanningError(f"--fail {text!r}: kind=kill-writer kills the checkpoint writers of a save: use "
                                f"phase=save")
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
        self.compute_factor = self.link_factor = 1.0  # sustained slowdowns in force (see pace)
        self.fastest_compute_s: float | None = None  # the slow link's unit: its hold per message is F - 1 of these
        self.slow_until: dict[str, int] = {}  # kind -> first step it no longer applies (steps=N)

    def slowed(self) -> bool:
        """A sustained slowdown is in force (compute or link): operations are then stretched one by one."""
        return self.compute_factor > 1.0 or self.link_factor > 1.0

    def pace(self, what: str, seconds: float) -> None:
        """The executor's hook (``PipelineExecutor.pace``): stretch a compute operation of ``seconds`` to
        ``compute_factor`` times its length (busy: a slow device computes longer, it does not sleep), or hold
        a message back as a link ``link_factor`` times slower would (idle: the wire is slow, not the rank): for
        ``link_factor - 1`` times the fastest compute the rank has timed (``seconds``: the one that produced the
        message), the same for every message, as they are one size (an activation, its gradient). Not the
        message's own compute: that reads cold after each hold (op_trace), so the hold fed on itself, 0.59 s a
        message in one run of a test and 2.9 s in the next."""
        factor = self.compute_factor if what == "compute" else self.link_factor
        if factor <= 1.0 or seconds <= 0:
            return
        if what == "compute":
            _busy((factor - 1.0) * seconds)
        else:
            self.fastest_compute_s = min(seconds, self.fastest_compute_s or seconds)
            time.sleep((factor - 1.0) * self.fastest_compute_s)

    def __call__(self, step: int, phase: str) -> None:
        for kind, until in list(self.slow_until.items()):
            if step >= until:  # a sustained slowdown of steps=N is over
                del self.slow_until[kind]
                if kind == "slow":
                    self.compute_factor = 1.0
                else:
                    self.link_factor = 1.0
        for spec in self.specs:
            if spec in self.fired or spec.step != step or spec.phase != phase:
                continue
            if spec.kind in SUSTAINED and spec.factor:  # from here on, every operation (see pace)
                self.fired.add(spec)
                if spec.kind == "slow":
                    self.compute_factor = spec.factor
                else:
                    self.link_factor = spec.factor
                if spec.steps:
                    self.slow_until[spec.kind] = spec.step + spec.steps
                if self.store is not None:
                    self.store.set(f"odyssey/slowed/{self.ident}", f"{time.time()!r} {spec.kind} {spec.factor!r}")
                continue
            self.fired.add(spec)
            # said where the rank's output goes, before it acts (a test's harness may act on it: a freeze)
            print(f"[odyssey rank {self.ident}] injected fault: step={step},rank={self.ident},phase={phase},"
                  f"kind={spec.kind}", file=sys.stderr, flush=True)
            if self.store is not None:
                self.store.set(f"odyssey/injected/{self.ident}", repr(time.time()))
            if spec.kind == "kill-machine":
                _kill_machine()
            if spec.kind == "kill-writer":
                os.register_at_fork(after_in_child=_killed_at_start)
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
            elif spec.kind == "block":
                while True:
                    time.sleep(3600)
            elif spec.kind == "crash":
                import faulthandler

                faulthandler._sigsegv()  # a real SIGSEGV, raised in C
            elif spec.kind == "error":
                raise InjectedError(f"injected error (--fail step={step},rank={self.ident},phase={phase},kind=error)")
            elif spec.kind == "slow":
                time.sleep(SLOW_S)
            elif spec.kind == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)  # (its handler, if any, runs here, in the main thread)
            elif spec.kind == "deadline":
                from ..megatron_lm.fault_injection import reach_the_time_limit

                reach_the_time_limit()
            elif spec.kind == "exit":
                self._leave(spec, f"the training script ended the job (--fail step={step},rank={self.ident},"
                                  f"phase={phase},kind=exit,code={spec.code})")

    def _leave(self, spec: FailSpec, why: str) -> None:
        """Say so, then leave at once with the code (no teardown: the test is the agent's answer to the exit)."""
        if self.store is not None:
            from .control_plane import say_leaving

            say_leaving(self.store, self.ident, spec.code, why)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(spec.code)


def _busy(cpu_seconds: float) -> None:
    """Spend ``cpu_seconds`` of this thread's CPU time (what the executor's compute clock counts on the CPU)."""
    end = time.thread_time() + cpu_seconds
    x = 0
    while time.thread_time() < end:
        for _ in range(200):
            x += 1


def _killed_at_start() -> None:
    """A forked child of a rank under ``kind=kill-writer``: SIGKILLed before it does anything (exec'd children, such
    as multiprocessing's spawned ones, run no fork hooks)."""
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_machine() -> None:
    """SIGKILL this rank's launcher and every rank it started (each leads its own process group), then
    this rank: what a machine's power loss does."""
    from .process_probe import children_of

    launcher = os.getppid()
    siblings = children_of(launcher)
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
