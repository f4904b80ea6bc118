"""Who is at fault for a stop in progress, judged on pictures of heartbeats (no job: ``ProgressJudge`` reads only
beats and the clock). The agent's use of it, with real processes fenced, is in ``test_agent_records.py``."""
from __future__ import annotations

import time

from megatron_odyssey.runtime.liveness import COMM, IDLE, WAITING, WORKING, Beat
from megatron_odyssey.runtime.progress_judge import ProgressJudge, Stall


class Judged:
    """A judge with the agent's timeouts whose words and stack requests are kept for the test."""

    def __init__(self, soft_s: float, hard_s: float, first_step_s: float = 600.0):
        self.said: list[str] = []
        self.dumped: list[int] = []
        self.judge = ProgressJudge(soft_s, hard_s, first_step_s, self.said.append, self.dumped.append)

    def look(self, beats: dict[int, Beat], now: float, warm: bool = True, step_started: float = 0.0,
             finishing: tuple[int, ...] = ()) -> Stall | None:
        return self.judge.stalled(sorted(beats), beats, now, warm, step_started, lambda i, t: i in finishing)

    def words(self) -> str:
        out, self.said[:] = "\n".join(self.said), []
        return out


def test_a_rank_left_behind_the_others_between_steps_is_named_then_fenced() -> None:
    """A rank stopped at a stop of Megatron's loop (its terminal's pipe full inside training_log, a save hung on its
    file system) while every other member waits ahead of it, at a later stop or inside the next step, and none
    of them moves: named with its stacks at the soft timeout, fenced at the hard one (in a save, --first-step-timeout
    later than that); never while a peer still moves, while several are equally far behind, while everyone is at the
    same stop (a long save), or while a recovery is under way."""
    judged = Judged(soft_s=20.0, hard_s=40.0)
    now, calls, found = time.time(), [], []

    def beats(behind_s: float, ahead_s: float, ahead: tuple = (COMM, 5, 0, "grad-sync"),
              behind: tuple = (4, 1, "between"), also_behind: int | None = None, in_collective: bool = False) -> int | None:
        state, step, stop, phase = ahead
        pictured = {i: Beat(now, 10, state, step, phase, now - ahead_s, stop, in_collective) for i in range(3)}
        calls.append(1)  # (each case a fresh stop: named once per stop)
        pictured[3] = Beat(now, len(calls), IDLE, behind[0], behind[2], now - behind_s, behind[1])
        if also_behind is not None:
            pictured[also_behind] = pictured[3]
        found.append(judged.look(pictured, now))
        return found[-1].rank if found[-1] else None

    # the others inside the next step
    assert beats(behind_s=30, ahead_s=25) is None  # named (soft timeout), not yet fenced
    assert ("rank 3 has stopped for 30.0 s at between after step 4 (idle) while ranks [0, 1, 2] wait further on; "
            "its stacks are dumped to its log; fenced after --hard-timeout 40 s") in judged.words()
    assert judged.dumped == [3]  # its stacks asked for once it was named
    assert beats(behind_s=41, ahead_s=45) == 3
    assert (found[-1].why, found[-1].bound) == ("stopped for 41.0 s at between after step 4 while ranks [0, 1, 2] "
                                                "wait further on and its heartbeat went on", "--hard-timeout 40 s")
    assert found[-1].waiting == [0, 1, 2]
    assert found[-1].since == now - 41  # the failure's detection time counts from there, not from the fencing
    # the others at a later stop after the same step: in training_log's collective, the exit check's
    assert beats(behind_s=41, ahead_s=45, ahead=(IDLE, 4, 2, "log")) == 3
    assert beats(behind_s=41, ahead_s=45, ahead=(IDLE, 4, 3, "exit"), behind=(4, 2, "log")) == 3
    # in an evaluation's forward: ahead of a rank left at the timer's barrier before it
    assert beats(behind_s=41, ahead_s=45, ahead=(WORKING, 4, 2, "eval")) == 3
    # at the same stop (training_log), the only one there not in the collective the others wait in
    in_log = (IDLE, 4, 2, "log")
    assert beats(behind_s=41, ahead_s=45, ahead=in_log, behind=(4, 2, "log")) is None  # not known to be in one
    assert beats(behind_s=41, ahead_s=45, ahead=in_log, behind=(4, 2, "log"), in_collective=True) == 3
    assert found[-1].why.startswith("stopped for 41.0 s at log after step 4 while ranks [0, 1, 2] wait in a "
                                    "collective there that it has not entered")
    assert beats(behind_s=41, ahead_s=45, ahead=in_log, behind=(4, 2, "log"), in_collective=True,
                 also_behind=0) is None  # two out of it: either may be what the others wait for
    # in a save: --first-step-timeout longer
    judged.words()
    assert beats(behind_s=41, ahead_s=45, behind=(4, 3, "save")) is None
    assert judged.words() == ""  # (not even named yet: a save takes its time)
    assert beats(behind_s=599, ahead_s=620, behind=(4, 3, "save")) is None
    said = judged.words()
    assert "rank 3 has stopped for 599.0 s at save after step 4" in said
    assert "fenced after --first-step-timeout 600 s (a save)" in said
    assert beats(behind_s=601, ahead_s=620, behind=(4, 3, "save")) == 3
    assert found[-1].bound == "--first-step-timeout 600 s"
    # not: a peer moved a moment ago; nobody ahead (every member in the same save); two equally far behind
    assert beats(behind_s=41, ahead_s=10) is None
    assert beats(behind_s=700, ahead_s=650, ahead=(IDLE, 4, 1, "between")) is None
    assert beats(behind_s=41, ahead_s=45, also_behind=0) is None
    assert beats(behind_s=41, ahead_s=45, ahead=(WAITING, 5, 0, "optimizer")) is None  # waiting on the agent
    judged.judge.recovering = {0}
    assert beats(behind_s=700, ahead_s=650) is None  # a recovery is under way


def test_a_rank_stopped_in_its_own_work_is_fenced_with_the_time_it_stopped() -> None:
    """A rank stopped inside a step while its heartbeat goes on (a kernel that never ends: Megatron's GPU_SLEEP),
    its peers waiting on it in communication: fenced at the hard timeout, and the stall carries when it stopped, so
    the failure's detection time counts from there (a fault Odyssey did not inject has no other start)."""
    judged, now = Judged(soft_s=10.0, hard_s=20.0), time.time()
    beats = {i: Beat(now, 10, COMM, 3, "forward", now - 18, 0, True) for i in (0, 2, 3)}
    beats[1] = Beat(now, 7, WORKING, 3, "start", now - 21, 0)
    stall = judged.look(beats, now)
    assert stall is not None and stall.rank == 1 and stall.waiting == [0, 2, 3]
    assert stall.since == now - 21 and stall.bound == "--hard-timeout 20 s"
    assert ("rank 1 has made no progress for 21.0 s inside step 3 (last operation: start, working); ranks [0, 2, 3] "
            "wait on it in communication") in judged.words()
    beats[1] = Beat(now, 8, WORKING, 3, "start", now - 19, 0)
    assert judged.look(beats, now) is None  # named at the soft timeout, not yet fenced
    assert judged.dumped == [1, 1]  # (each a fresh stop: its beat count moved)
    judged.words()
    # a rank that said it finished the job is shutting down: neither named nor fenced
    beats[1] = Beat(now, 9, WORKING, 3, "start", now - 40, 0)
    assert judged.look(beats, now, finishing=(1,)) is None and judged.words() == ""


def test_ranks_that_all_wait_in_communication_on_each_other_are_named_as_such() -> None:
    """Ranks 2 and 3 stopped inside the same collective, both waiting in communication, nobody in its own work (a
    link between their machines that carries nothing, or a hang inside the collective itself), while ranks 0 and 1
    wait on the agent for the commit: the first to stop (rank 2) is fenced at the hard timeout, and the words say
    that the others wait too rather than that they wait on it."""
    judged, now = Judged(soft_s=5.0, hard_s=10.0), time.time()
    beats = {i: Beat(now, 10, WAITING, 2, "commit", now - 12, 0) for i in (0, 1)}
    beats[2] = Beat(now, 9, COMM, 2, "grad-sync", now - 11, 0, True)
    beats[3] = Beat(now, 9, COMM, 2, "grad-sync", now - 10.5, 0, True)
    stall = judged.look(beats, now)
    assert stall is not None and stall.rank == 2 and stall.waiting == [3]
    assert stall.why == ("made no progress for 11.0 s inside step 2 (last operation: grad-sync) while its heartbeat "
                         "went on, as did ranks [3], waiting in communication too")
    words = judged.words()
    assert ("rank 2 has made no progress for 11.0 s inside step 2 (last operation: grad-sync, comm); ranks [3] wait in "
            "communication too, stopped since later: a hang inside the collective or a path between them that carries "
            "nothing") in words and "wait on it" not in words


def test_a_generations_first_step_is_judged_only_after_the_first_step_timeout() -> None:
    """A generation's first step connects, allocates and compiles: until it has run --first-step-timeout nobody is
    judged by progress (and judging restarts from then), after it a rank stopped in its own work is fenced as in
    any step."""
    judged, now = Judged(soft_s=10.0, hard_s=20.0, first_step_s=100.0), time.time()
    beats = {i: Beat(now, 3, COMM, 0, "forward", now - 50, 0, True) for i in (0, 2, 3)}
    beats[1] = Beat(now, 2, WORKING, 0, "forward", now - 50, 0)
    assert judged.look(beats, now, warm=False, step_started=now - 60) is None
    assert judged.judge.judged_from == now and judged.words() == ""
    later = now + 45  # the first step has run 105 s; rank 1 has not moved since (stopped 45 s since judging began)
    stall = judged.look(beats, later, warm=False, step_started=now - 60)
    assert stall is not None and stall.rank == 1 and stall.why.startswith("made no progress for 45.0 s inside step 0")


def test_heartbeats_from_before_a_recovery_blame_nobody_in_the_next_generation() -> None:
    """On an H200 a survivor was fenced 0.02 s after the new generation's first commit: the recovery and that step
    took under a heartbeat interval, so the agent still held every survivor's last beat from the broken generation,
    all stopped 21 s at the log stop where the fenced rank had held them up, one of them just out of the collective
    (it had seen the abort). Such beats tell nothing about the new generation; fresh ones are judged as before."""
    judged, now = Judged(soft_s=10.0, hard_s=20.0), time.time()
    judged.judge.new_generation(now - 1.0)
    judged.judge.judged_from = now - 0.02  # (the generation's first commit)
    beats = {i: Beat(now - 1.2, 40, IDLE, 2, "log", now - 21.0, 1, i != 0) for i in (0, 2, 3)}
    assert judged.look(beats, now) is None
    assert "rank 0" not in judged.words()
    # the same picture heard in this generation is a rank the others wait for: fenced at the hard timeout
    beats = {i: Beat(now, 40, IDLE, 2, "log", now - 21.0, 1, i != 0) for i in (0, 2, 3)}
    stall = judged.look(beats, now)
    assert stall is not None and stall.rank == 0 and stall.waiting == [2, 3]


def test_a_survivor_leaving_the_collective_a_fenced_rank_held_up_is_not_fenced_for_the_wait() -> None:
    """Seen on core_r0.13.0: rank 1 blocked at the exit check after iteration 3 while 0, 2 and 3 waited in its
    collective; fenced at the hard timeout (10 s), its peers left the collective with an error, one by one. For a
    moment rank 3 was out of it while the beats of 0 and 2 still said they were in it: rank 3 looked like the one
    they all waited for, stopped since before the fence, and was fenced at once, a second rank lost to one fault.
    A stop now counts from the last abort; a rank still stopped the hard timeout after it is fenced as before."""
    judged, now = Judged(soft_s=5.0, hard_s=10.0), time.time()
    judged.judge.new_generation(now - 60.0)
    judged.judge.aborted(now - 0.3)  # rank 1 was fenced and the step aborted 0.3 s ago
    beats = {i: Beat(now, 40, IDLE, 2, "exit", now - 10.4, 1, i != 3) for i in (0, 2, 3)}
    assert judged.look(beats, now) is None
    assert "rank 3" not in judged.words()
    # still there, out of the collective, the hard timeout after the abort: what the others wait for
    later = now + 10.0
    beats = {i: Beat(later, 50, IDLE, 2, "exit", now - 10.4, 1, i != 3) for i in (0, 2, 3)}
    stall = judged.look(beats, later)
    assert stall is not None and stall.rank == 3 and stall.waiting == [0, 2]
    assert "rank 3 has stopped for 10.3 s at exit after step 2" in judged.words()
