"""Which rank is at fault for a stop in progress, judged from the ranks' heartbeats (:mod:`.liveness`).

A heartbeat only proves that a process runs; its progress says whether the rank's main thread moves. When some
ranks stop, who waits tells who is at fault (C4D): ranks blocked in communication wait on a peer; a rank stopped
while *working* (in its own computation, or in a collective its peers never entered) is the cause. Between steps
every rank makes the same stops in the same order, so the one left behind every other, or the one at the same
stop outside the collective the others wait in, is what they wait for. The culprit is named at the soft timeout
(its stacks dumped to its log) and returned as a :class:`Stall` at the hard one; the agent fences it.

Kept apart from the agent, which owns the processes, the store and the fence: this module only reads beats and
the clock, so each rule can be checked on a picture of beats, without a job.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .liveness import COMM, IDLE, WAITING, WORKING, Beat


@dataclass(frozen=True)
class Stall:
    """A member found stopped by progress: why, the bound it passed, and who waits on it."""

    rank: int
    why: str
    bound: str
    waiting: list[int]
    since: float  # when it last made progress: where the failure's detection time starts
    together: bool = False  # nobody stopped in its own work: they all wait in communication (on each other)


@dataclass
class ProgressJudge:
    """The agent's timeouts and the moments judging restarts from; ``say`` names a rank on the terminal,
    ``dump_stacks`` asks it for its stacks (into its log)."""

    soft_timeout_s: float
    hard_timeout_s: float
    first_step_timeout_s: float
    say: Callable[[str], None]
    dump_stacks: Callable[[int], None]
    judged_from: float = 0.0  # progress is judged from the last abort (or a generation's first commit) on
    aborted_at: float = 0.0  # the last abort: a stop between steps counts from it (see _behind_the_others)
    generation_began: float = 0.0  # when this generation's plan went out: older heartbeats tell of the last one
    recovering: set[int] = field(default_factory=set)  # ranks registered for the recovery in progress (not judged)
    named: set[tuple[int, int]] = field(default_factory=set)  # (rank, beat count) already named at the soft timeout

    def aborted(self, now: float) -> None:
        """The agent aborted the generation: ranks blocked on a fenced peer need a moment to notice."""
        self.judged_from = self.aborted_at = now

    def new_generation(self, now: float) -> None:
        """A new generation's plan went out: beats heard before it tell of the generation that broke."""
        self.judged_from = self.generation_began = now

    def stalled(self, live: list[int], beats: dict[int, Beat], now: float, warm: bool, step_started: float,
                finishing: Callable[[int, float], bool]) -> Stall | None:
        """The member of ``live`` at fault for a stop in progress, once it has been stopped for the hard timeout.

        Judged: members inside a step (not those waiting on the agent), from the first commit of a
        generation on (``warm``; its first step, begun at ``step_started``, connects, allocates and compiles: judged
        too once it has run past ``first_step_timeout_s``), only while no member is starting
        up or outside a step (the others may be waiting on it), and only since the last abort (ranks blocked
        on a fenced peer need a moment to notice). Who waits tells who is at fault (C4D): ranks blocked in
        communication wait on a peer; a rank stopped while *working* (in its own computation, or in a
        collective its peers never entered) is the cause. When every stopped rank is in communication (a
        hang inside the collective itself) the first to stop is taken. The culprit is named at the soft
        timeout, with its stacks dumped to its log. ``finishing(rank, now)``: the rank said it finished the job and
        is shutting down, not stopped."""
        if not warm and now - step_started < self.first_step_timeout_s:
            # a generation's first step connects, allocates and compiles: judged only once it has taken longer
            # than --first-step-timeout (a data loader deadlocked at its fork, a first collective that never forms)
            self.judged_from = now
            return None
        if any(i not in beats or beats[i].state == IDLE for i in live):
            # a member still starting up, or outside a step (saving, logging): working ranks may be waiting
            # on it, and nothing can be attributed by progress; judge again from when every member is back in a
            # step; meanwhile a member left behind the others while none of them moves is what they wait for
            self.judged_from = now
            return self._behind_the_others(live, beats, now, finishing)
        idle = {i: now - max(beats[i].since, self.judged_from) for i in live
                if beats[i].state in (WORKING, COMM) and i not in self.recovering}
        stopped = [i for i, s in idle.items() if s >= self.soft_timeout_s]
        culprits = [i for i in stopped if beats[i].state == WORKING] or stopped
        if not culprits:
            return None
        first = max(culprits, key=lambda i: (idle[i], -i))
        if finishing(first, now):  # (its heartbeat thread still beats while its teardown waits)
            return None
        beat = beats[first]
        waiting = sorted(i for i in stopped if i != first and beats[i].state == COMM)
        # nobody stopped in its own work: they all wait in communication, on each other (a hang inside the
        # collective, or a network path between them that carries nothing: a partition that is not transitive)
        stuck_together = beat.state == COMM and bool(waiting)
        together = (f"; ranks {waiting} wait in communication too, stopped since later: a hang inside the collective "
                    f"or a path between them that carries nothing (the first to stop is fenced; if the others still "
                    f"cannot reach each other, the next stop fences another)") if stuck_together else ""
        if (first, beat.count) not in self.named:
            self.named.add((first, beat.count))
            self.say(f"rank {first} has made no progress for {idle[first]:.1f} s inside step {beat.step} (last "
                     f"operation: {beat.phase}, {beat.state})"
                     + (together or (f"; ranks {waiting} wait on it in communication" if waiting else ""))
                     + f"; its stacks are dumped to its log; fenced after --hard-timeout {self.hard_timeout_s:g} s")
            self.dump_stacks(first)
        if idle[first] < self.hard_timeout_s:
            return None
        return Stall(first, f"made no progress for {idle[first]:.1f} s inside step {beat.step} (last operation: "
                            f"{beat.phase}) while its heartbeat went on"
                            + (f", as did ranks {waiting}, waiting in communication too" if stuck_together else ""),
                     f"--hard-timeout {self.hard_timeout_s:g} s",
                     sorted(i for i in live if i != first and beats[i].state == COMM), beat.since, stuck_together)

    def _behind_the_others(self, live: list[int], beats: dict[int, Beat], now: float,
                           finishing: Callable[[int, float], bool]) -> Stall | None:
        """A member left behind every other, at a stop of the loop between steps (``liveness``: every rank makes the
        same stops in the same order), or the one at the same stop as others that is not in the torch.distributed
        collective they wait in, while none of them has moved for the hard timeout: what they wait for (a rank
        blocked writing to its terminal's full pipe, a save hung on its file system). Named with its stacks dumped
        once it has stopped for the soft timeout, fenced at the hard one; in a save both wait
        ``--first-step-timeout`` longer (a save takes its time). Never while a member is starting up, recovering or
        waiting on the agent, nor when nothing tells which one the others wait for (several equally far behind
        and out of any collective). A stop counts from the last abort at the earliest: a fenced rank's peers leave
        the collective it held up with an error, one by one, and the first to leave looked, for as long as the
        others' heartbeats still said they were in it, like the one they all waited for, stopped since before the
        fence (on core_r0.13 a survivor was fenced for it the moment its peer was)."""
        if len(live) < 2 or any(i not in beats or i in self.recovering or beats[i].state == WAITING
                                or beats[i].t < self.generation_began for i in live):
            # (a heartbeat from before this generation's plan says where the rank waited when the last one broke:
            # a recovery and a first step take less than a heartbeat interval on a GPU, and the peers the last
            # stall held up still look stopped there for as long - on an H200 a survivor was fenced for it)
            return None
        last = min(beats[i].position for i in live)
        behind = [i for i in live if beats[i].position == last]
        if len(behind) > 1:  # at the same stop: the one not in the collective the others there wait in
            behind = [i for i in behind if not beats[i].in_collective]
        if len(behind) != 1:
            return None
        (first,) = behind
        others = [i for i in live if i != first]
        beat = beats[first]
        stopped = now - max(beat.since, self.aborted_at)
        extra = (self.first_step_timeout_s - self.hard_timeout_s) if beat.phase == "save" else 0.0
        waited = min(now - max(beats[i].since, self.aborted_at) for i in others)
        if stopped < self.soft_timeout_s + extra or waited < self.soft_timeout_s or finishing(first, now):
            return None
        where = f"{beat.phase or '-'} after step {beat.step}" if beat.state == IDLE else f"{beat.phase} of step {beat.step}"
        level = [i for i in others if beats[i].position == beat.position]
        ahead = [i for i in others if i not in level]
        waiting = " and ".join(([f"ranks {level} wait in a collective there that it has not entered"] if level else [])
                               + ([f"ranks {ahead} wait further on"] if ahead else []))
        if (first, beat.count) not in self.named:
            self.named.add((first, beat.count))
            self.say(f"rank {first} has stopped for {stopped:.1f} s at {where} ({beat.state}) while {waiting}; its "
                     f"stacks are dumped to its log; fenced after "
                     + (f"--first-step-timeout {self.first_step_timeout_s:g} s (a save)" if extra else
                        f"--hard-timeout {self.hard_timeout_s:g} s"))
            self.dump_stacks(first)
        if stopped < self.hard_timeout_s + extra or waited < self.hard_timeout_s:
            return None
        bound = f"--first-step-timeout {self.first_step_timeout_s:g} s" if extra else \
            f"--hard-timeout {self.hard_timeout_s:g} s"
        return Stall(first, f"stopped for {stopped:.1f} s at {where} while {waiting} and its heartbeat went on", bound,
                     others, beat.since)
