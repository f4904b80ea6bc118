"""How each rank's process left, or is leaving: by the script's own decision with a code it chose, finished and
shutting down, or ended by a signal or an error outside Odyssey's reach. The agent asks here before it calls a
silent or exited rank a failure; what the job then does about it (recover, stop, end with the script's code) stays
the agent's decision."""
from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .control_plane import DONE_KEY, LEAVING_KEY
from .errors import describe_exit, indented


@dataclass
class RankExits:
    procs: dict[int, Any]  # the agent's rank processes (its own dict: a rank admitted later is seen here too)
    hard_timeout_s: float
    log: Callable[[str], None]
    log_error: Callable[[str], None]
    last_traceback: Callable[[int], str]  # a rank's log's last traceback
    store: Any = None  # the job's store (the agent's, once it exists)
    exiting: dict[int, float] = field(default_factory=dict)  # rank -> when first seen finished but not yet exited
    leaving: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> the exit the script chose, once left
    endings: dict[int, str] = field(default_factory=dict)  # a failed rank without an error record -> how it ended
    killed_after_done: set[int] = field(default_factory=set)  # finished, then killed lingering: its work is done

    def left_on_purpose(self, ident: int, code: int | None) -> bool:
        """The rank said, before it left, that it leaves with this code by the script's own decision (Megatron-LM's
        rerun state machine: every rank leaves with it after the checkpoint it asked for). ``code`` None: the rank
        has not left yet but is silent, past the save that exit asked for and tearing down its process groups (which
        can hold the GIL and so stop its heartbeat: seen on core_r0.12.0 under torch 2.7.1): not hung either, and
        the job ends with the code it said (the agent's ``_ended_by_the_script``)."""
        if ident not in self.leaving:
            try:
                said = self.store.check([LEAVING_KEY.format(ident)])
                leaving = json.loads(self.store.get(LEAVING_KEY.format(ident))) if said else None
            except Exception:  # noqa: BLE001 - the store is the agent's: a failure here is not the rank's
                return False
            if not leaving or (code is not None and leaving.get("code") != code):
                return False
            self.leaving[ident] = leaving
        return True

    def said_done(self, ident: int) -> bool:
        """The rank finished the job (its exit handler said so): its heartbeat thread stops with the
        interpreter, and tearing down a world of dead peers can take a while. Said on a clean end only
        (``clean_exit.say_done``; at interpreter exit, not after an uncaught exception), so also where the job ends
        before ``--train-iters``: every rank takes Megatron's exit decision together."""
        if ident in self.exiting:
            return True
        try:
            said = self.store.check([DONE_KEY.format(ident)])
        except Exception:  # noqa: BLE001 - the store is the agent's: a failure here is not the rank's
            return False
        if said:
            self.exiting[ident] = time.time()
        return said

    def finishing(self, ident: int, now: float) -> bool:
        """The rank said it finished: it is shutting down, not hung (past its last step, or its job ended by
        Megatron's own decision before it: --exit-interval, --exit-duration-in-mins, a signal sent to the ranks
        themselves), so it is neither named nor fenced as a stall: it is left to :meth:`finish_exit`. Asked before
        a stall is named, whose stack dump's signal could kill a process this far into its exit."""
        if not self.said_done(ident):
            return False
        self.finish_exit(ident, now)
        return True

    def finish_exit(self, ident: int, now: float) -> None:
        """A finished rank still exiting after the hard timeout is killed; its work is done, so it counts as
        a clean exit (the agent's ``detect`` passes over it from then on). No stacks are asked for: a process this
        far into its exit may have dropped faulthandler's handler, and the signal would kill it (seen on
        core_r0.12.0)."""
        if now - self.exiting[ident] > self.hard_timeout_s:
            self.log(f"rank {ident} finished the job but has not exited for {self.hard_timeout_s:.0f} s: "
                     f"killing it (its work is done: not a failure)")
            self.procs[ident].kill()
            self.killed_after_done.add(ident)

    def say_how_it_ended(self, ident: int) -> None:
        """A rank that failed without an error record of its own: a signal (the kernel's OOM killer, a
        scheduler, a crash in native code, Megatron's fault injector) or an exception outside Odyssey's
        reach. Its exit status and its log's last traceback go to the terminal, not only to its log."""
        code = self.procs[ident].exitcode
        if code is None or code == 0:
            return
        self.endings[ident] = ended = describe_exit(code)
        if code == -signal.SIGKILL:
            self.log_error(f"rank {ident} {ended} (it cannot leave a trace: the OOM killer, a scheduler, a person "
                           f"or a fault injector sent it)")
        else:
            self.log_error(f"rank {ident} {ended}; the end of its log:\n" + indented(self.last_traceback(ident)))

    def fenced(self, ident: int, why: str) -> None:
        self.endings[ident] = f"was fenced (SIGKILL): {why}"

    def endings_of(self, ranks: set[int]) -> dict[int, str]:
        return {i: self.endings[i] for i in sorted(ranks) if i in self.endings}

    def replaced(self, ident: int) -> None:
        """A new process took the rank (a joiner admitted): its old process's finish says nothing about it."""
        self.exiting.pop(ident, None)
