"""When this process was stopped whole: a machine paused (a VM paused for a live migration or by its host, a hung
kernel, every process SIGSTOPped) and then going on.

A launcher's own loop cannot tell: it spends its time in store calls, which may also block for a network blip while
the process runs. A thread that does nothing but tick can: its clock jumps only where no thread of the process ran,
so a jump says the process (or its machine) stood still for that long. CLOCK_MONOTONIC goes on during a SIGSTOP
or a hung kernel; a paused VM's guest clock may not count the pause (up to its hypervisor), but its wall clock is
set right on resume (its time sync): a gap is the larger of the two clocks' (a wall clock stepped while the process
runs only matters with a fence seen just after it). Checked with SIGSTOP only (no VM here). No torch here (the
launcher's import stays fast)."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Pause:
    began: float  # time.monotonic() of the last tick before it
    ended: float  # ... and of the first tick after it
    wall_s: float = 0.0  # time.time()'s gap over the same two ticks

    @property
    def seconds(self) -> float:
        return max(self.ended - self.began, self.wall_s)


@dataclass
class PauseClock:
    """Ticks every ``tick_s``; a gap of ``at_least_s`` or more between two ticks is a :class:`Pause`. The default
    records short gaps too (a loaded machine's scheduler makes some): who asks judges a pause's length against its
    own threshold, which may be short (half a heartbeat timeout of 2 s); the newest ``keep`` are kept."""

    at_least_s: float = 0.25
    tick_s: float = 0.05
    keep: int = 1024
    pauses: list[Pause] = field(default_factory=list)
    last_tick: float = field(default_factory=time.monotonic)
    last_wall: float = field(default_factory=time.time)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> "PauseClock":
        self.last_tick, self.last_wall = time.monotonic(), time.time()
        threading.Thread(target=self._run, name="odyssey-pause-clock", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            self.tick()

    def tick(self) -> None:
        now, wall = time.monotonic(), time.time()
        pause = Pause(self.last_tick, now, wall - self.last_wall)
        if pause.seconds >= self.at_least_s:
            self.pauses = [*self.pauses, pause][-self.keep:]  # (a new list: a reader's copy stays whole)
        self.last_tick, self.last_wall = now, wall

    def longest_since(self, t: float) -> Pause | None:
        """The longest pause that ended at or after ``t`` (time.monotonic()), if any, the one the clock has not
        ticked after yet included (a thread woken from the same pause may ask before this one's next tick)."""
        ongoing = Pause(self.last_tick, time.monotonic(), time.time() - self.last_wall)
        pauses = [p for p in list(self.pauses) if p.ended >= t]
        if ongoing.seconds >= self.at_least_s:
            pauses.append(ongoing)
        return max(pauses, key=lambda p: p.seconds, default=None)


@dataclass
class StandStillFences:
    """A launcher's ranks that the agent fenced while their machine stood still, and for how long it did: the
    fence of each is judged when the launcher first sees it, against the stand-stills since its previous pass began
    (a fence seen now was set after that). A stand-still counts from half the job's heartbeat timeout (``at_least_s``
    once the job's config is known; the clock records shorter ones too): the agent fences a silent rank after the
    whole timeout, less one beat."""

    clock: PauseClock = field(default_factory=lambda: PauseClock().start())
    at_least_s: float | None = None
    fenced: dict[int, float] = field(default_factory=dict)  # rank -> seconds the machine stood still
    seen: set[int] = field(default_factory=set)
    pass_began: float = field(default_factory=time.monotonic)
    previous_pass: float = field(default_factory=time.monotonic)

    def new_pass(self) -> None:
        self.previous_pass, self.pass_began = self.pass_began, time.monotonic()

    def fence_seen(self, ident: int, heartbeat_timeout_s: Callable[[], float | None]) -> None:
        """The launcher sees rank ``ident``'s fence (judged the first time only); ``heartbeat_timeout_s``: the job's,
        None while unknown (asked only after a stand-still)."""
        if ident in self.seen:
            return
        self.seen.add(ident)
        pause = self.clock.longest_since(self.previous_pass)
        if pause is None:
            return
        if self.at_least_s is None and (timeout := heartbeat_timeout_s()) is not None:
            self.at_least_s = timeout / 2
        if self.at_least_s is not None and pause.seconds >= self.at_least_s:
            self.fenced[ident] = pause.seconds

    def life_started(self, ident: int) -> None:
        self.fenced.pop(ident, None)
        self.seen.discard(ident)

    def stop(self) -> None:
        self.clock.stop()
