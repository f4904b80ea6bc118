"""Results of a simulation: per-seed timelines, their averages, and the JSON of the CLI contract:

``{"config", "policies": {NAME: {"avg_throughput", "samples", "downtime_s", "reconfigurations"}},
"ratios": {"odyssey/oobleck", "odyssey/recycle", "odyssey/fault-scaled"}}``

Values are means over seeds; spread fields (``*_std``, ``*_min``, ``*_max``) and the mean of the
per-seed ratios are extras. A ratio is the ratio of the mean average throughputs (null if either
policy was not simulated or the denominator is 0).
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from .timeline import PolicyRun

CONTRACT_RATIOS = ("odyssey/oobleck", "odyssey/recycle", "odyssey/fault-scaled")


def _stats(xs: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "min": min(xs), "max": max(xs)}


@dataclass
class PolicySummary:
    name: str
    runs: list[PolicyRun]

    @property
    def avg_throughput(self) -> float:
        return statistics.fmean(r.avg_throughput for r in self.runs)

    def to_json(self, fault_free: float) -> dict[str, Any]:
        thr = _stats([r.avg_throughput for r in self.runs])
        kinds: dict[str, float] = {}
        for r in self.runs:
            for k, v in r.counts().items():
                kinds[k] = kinds.get(k, 0.0) + v / len(self.runs)
        return {
            "avg_throughput": thr["mean"],
            "samples": statistics.fmean(r.samples for r in self.runs),
            "downtime_s": statistics.fmean(r.downtime_s for r in self.runs),
            "reconfigurations": statistics.fmean(r.reconfigurations for r in self.runs),
            "avg_throughput_std": thr["std"],
            "avg_throughput_min": thr["min"],
            "avg_throughput_max": thr["max"],
            "fraction_of_fault_free": thr["mean"] / fault_free if fault_free > 0 else None,
            "lost_samples": statistics.fmean(r.lost_samples for r in self.runs),
            "reactions": dict(sorted(kinds.items())),
        }


@dataclass
class SimulationResult:
    config: dict[str, Any]
    fault_free_throughput: float  # samples/s of the job as launched, without failures
    seeds: list[int]
    policies: dict[str, PolicySummary] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)  # profile name, MTBF used, wall time, ...

    def ratio(self, num: str, den: str) -> float | None:
        if num not in self.policies or den not in self.policies:
            return None
        d = self.policies[den].avg_throughput
        return self.policies[num].avg_throughput / d if d > 0 else None

    def seed_ratios(self, num: str, den: str) -> list[float]:
        if num not in self.policies or den not in self.policies:
            return []
        return [a.avg_throughput / b.avg_throughput
                for a, b in zip(self.policies[num].runs, self.policies[den].runs) if b.avg_throughput > 0]

    def to_dict(self) -> dict[str, Any]:
        ratios = {}
        for key in CONTRACT_RATIOS:
            num, den = key.split("/")
            ratios[key] = self.ratio(num, den)
        spread = {}
        for key in CONTRACT_RATIOS:
            xs = self.seed_ratios(*key.split("/"))
            if xs:
                spread[key] = _stats(xs)
        return {
            "config": self.config,
            "policies": {n: s.to_json(self.fault_free_throughput) for n, s in self.policies.items()},
            "ratios": ratios,
            "ratio_spread": spread,
            "fault_free_throughput": self.fault_free_throughput,
            "seeds": self.seeds,
            "info": self.info,
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(_clean(self.to_dict()), indent=indent)


def _clean(x: Any) -> Any:
    """JSON has no inf/nan: write null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x
