"""``runtime.pause_clock``: a real process stopped whole (SIGSTOP) and continued sees exactly that stand-still."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from megatron_odyssey.runtime.pause_clock import PauseClock

CHILD = """
import json, sys, time
from pathlib import Path
from megatron_odyssey.runtime.pause_clock import PauseClock
clock = PauseClock(at_least_s=1.5).start()
print("ready", flush=True)
go_on = Path(sys.argv[1])
while not go_on.exists():
    time.sleep(0.2)  # (a busy main thread is no stand-still: the clock ticks in its own thread)
print(json.dumps([p.seconds for p in clock.pauses]), flush=True)
"""


def test_a_process_stopped_whole_sees_one_pause_of_that_length(tmp_path: Path) -> None:
    go_on = tmp_path / "go_on"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(go_on)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(1.5)  # (running: no pause)
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(3.0)
        os.kill(child.pid, signal.SIGCONT)
        time.sleep(0.5)
        go_on.touch()
        pauses = json.loads(child.stdout.readline())
        assert len(pauses) == 1 and 2.9 <= pauses[0] < 5.0, pauses
    finally:
        child.kill()
        child.wait()


def test_a_stand_still_the_clock_has_not_ticked_after_yet_is_seen() -> None:
    """A thread woken from the same stand-still may ask before the clock's next tick: the gap since its last tick
    counts (here a clock that never started, its last tick 3 s ago)."""
    clock = PauseClock(at_least_s=2.0)
    clock.last_tick = time.monotonic() - 3.0
    pause = clock.longest_since(time.monotonic() - 10.0)
    assert pause is not None and 3.0 <= pause.seconds < 4.0
    assert PauseClock(at_least_s=2.0).longest_since(0.0) is None  # (just made: no gap)
    # a paused VM whose guest's monotonic clock did not count the pause: its wall clock, set right on resume, did
    clock = PauseClock(at_least_s=2.0)
    clock.last_wall = time.time() - 8.0
    pause = clock.longest_since(time.monotonic() - 10.0)
    assert pause is not None and 8.0 <= pause.seconds < 9.0


def test_a_fence_first_seen_after_a_stand_still_of_half_the_heartbeat_timeout_is_the_stand_stills() -> None:
    """``StandStillFences``: judged at the first sight of each fence, against the stand-stills since the previous
    pass began; the threshold, half the job's heartbeat timeout, asked for only once a stand-still is there."""
    from megatron_odyssey.runtime.pause_clock import StandStillFences

    asked: list[int] = []

    def timeout() -> float:
        asked.append(1)
        return 10.0

    still = StandStillFences(clock=PauseClock(at_least_s=1.0))
    still.new_pass()
    still.fence_seen(2, timeout)  # no stand-still: a fence as any other
    assert still.fenced == {} and asked == []
    still.clock.last_tick = time.monotonic() - 3.0  # a 3 s stand-still, shorter than 5 s
    still.new_pass()
    still.fence_seen(3, timeout)
    assert still.fenced == {} and asked == [1] and still.at_least_s == 5.0
    still.clock.last_tick = time.monotonic() - 12.0
    still.new_pass()
    still.fence_seen(2, timeout)  # (seen before: judged then)
    still.fence_seen(4, timeout)
    assert list(still.fenced) == [4] and 12.0 <= still.fenced[4] < 13.0 and asked == [1]
    still.life_started(4)  # a new life: its fence will be judged afresh
    assert still.fenced == {} and 4 not in still.seen


def test_a_stand_still_shorter_than_two_seconds_counts_under_a_short_heartbeat_timeout() -> None:
    """The clock records short gaps; the judge is half the job's heartbeat timeout, here 2 s: a 1.5 s stand-still
    that the clock ticked after is one (a clock that kept only gaps of 2 s or more missed it)."""
    from megatron_odyssey.runtime.pause_clock import StandStillFences

    still = StandStillFences(clock=PauseClock())
    still.new_pass()
    still.clock.last_tick = time.monotonic() - 1.5
    still.clock.tick()
    assert [round(p.seconds, 1) for p in still.clock.pauses] == [1.5]
    still.new_pass()
    still.fence_seen(5, lambda: 2.0)
    assert list(still.fenced) == [5] and 1.5 <= still.fenced[5] < 1.6
    still.fence_seen(6, lambda: 2.0)  # (the same stand-still: another rank of the machine fenced for it)
    assert list(still.fenced) == [5, 6]
    still.clock.last_tick = time.monotonic() - 0.6  # shorter than half of 2 s: recorded, not a stand-still of note
    still.clock.tick()
    still.new_pass()
    still.fence_seen(7, lambda: 2.0)
    assert 7 not in still.fenced and [round(p.seconds, 1) for p in still.clock.pauses] == [1.5, 0.6]


def test_the_clock_keeps_only_its_newest_pauses() -> None:
    clock = PauseClock(keep=3)
    for gap in (1.0, 2.0, 3.0, 4.0):
        clock.last_tick = time.monotonic() - gap
        clock.tick()
    assert [round(p.seconds) for p in clock.pauses] == [2, 3, 4]
