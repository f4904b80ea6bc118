"""What one policy did over one seed: a step function of throughput and devices, plus the log of
its reactions. The engine produces it; the report and the tests read it."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Segment:
    start_s: float
    end_s: float
    throughput: float  # samples/s while in this segment
    state: str  # training | waiting | stopped | checkpoint | <reaction kind> (a transition)
    devices_alive: int  # devices of the cluster that are up (may exceed the job's size in a trace)
    devices_used: int  # devices doing work for this policy

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class LoggedReaction:
    time_s: float
    kind: str
    transition_s: float
    lost_samples: float
    note: str


@dataclass
class PolicyRun:
    policy: str
    seed: int
    horizon_s: float
    segments: list[Segment] = field(default_factory=list)
    reactions: list[LoggedReaction] = field(default_factory=list)
    trained_samples: float = 0.0  # everything computed
    lost_samples: float = 0.0  # computed, then thrown away (restart from checkpoint, failed step)

    @property
    def samples(self) -> float:
        """Samples that count: trained and not lost."""
        return self.trained_samples - self.lost_samples

    @property
    def avg_throughput(self) -> float:
        return self.samples / self.horizon_s if self.horizon_s > 0 else 0.0

    @property
    def downtime_s(self) -> float:
        return sum(s.duration_s for s in self.segments if s.throughput <= 0)

    @property
    def reconfigurations(self) -> int:
        """Plan changes after the job started (reroutes, reconfigurations, fills, restarts)."""
        return sum(1 for r in self.reactions if r.kind not in ("start", "stop", "none"))

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.reactions:
            out[r.kind] = out.get(r.kind, 0) + 1
        return out

    def add_segment(self, seg: Segment) -> None:
        if seg.end_s <= seg.start_s:
            return
        if self.segments:
            last = self.segments[-1]
            if (last.end_s == seg.start_s and last.throughput == seg.throughput and last.state == seg.state
                    and last.devices_alive == seg.devices_alive and last.devices_used == seg.devices_used):
                self.segments[-1] = Segment(last.start_s, seg.end_s, last.throughput, last.state,
                                            last.devices_alive, last.devices_used)
                return
        self.segments.append(seg)

    def throughput_at(self, t: float) -> float:
        for s in self.segments:
            if s.start_s <= t < s.end_s:
                return s.throughput
        return 0.0
