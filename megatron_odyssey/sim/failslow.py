"""Fail-slow (straggler) processes: what makes a live node slow, how often, by how much, for how long.

A node that fails slow keeps running, but every operation it computes takes ``factor`` times as long (the
planning estimator's ``slowdown=``); after a duration it runs at full speed again. Each *class* of fail-slow
is an independent alternating process per node: full speed for an exponential time with rate
``tp x rate_per_device_hour`` (a node slows with the first of its devices, like failures), then slow for an
exponential time with mean ``mean_duration_h`` (``None``: it stays slow), with a factor drawn uniformly from
``factors``. Two classes active on one node at once multiply (Greyhound's "compound" fail-slows).

The numbers of the presets come from Greyhound (Wu et al., "Greyhound: Hunting Fail-Slows in Hybrid-Parallel
Training at Scale", USENIX ATC '25; arXiv 2410.12588 "FALCON", same authors and study), §3, a production
cluster of over 10,000 GPUs (docs/simulation.md, "Fail-slow", gives the derivation of each number):

* computation fail-slows: 6 of 392 single-node probing jobs (4 H800 GPUs, 70-90 min each) -> 6 / (392 x 4 x
  1.33 h) = 0.0029 per GPU-hour; mean duration 10 min; factors 1.2 ("GPU0 was 20% slower", thermal
  throttling) and 1.28 ("maximum performance drop of 21.6%", CPU contention);
* communication fail-slows: 42 of 107 four-node probing jobs (8 A100 GPUs, about 5 h each) -> 42 / (107 x 8 x
  5 h) = 0.0098 per GPU-hour; mean duration 24 min; factors 1.39 and 1.84 (throughput 0.57 -> 0.41 -> 0.31
  iterations/s in the case study). The estimator has no per-link speeds, so a congested link is modelled as
  its node computing that much slower (our assumption);
* at scale (27 jobs of 512-1024 GPUs, one month): mean duration 72 min; throughput cut by 80 % and 85 % and to
  10 % of normal -> factors 5, 6.67 and 10. The paper gives no per-device rate for these; the ``-severe``
  preset uses the communication rate (our assumption).

Rates are lower bounds: the paper counts jobs that saw a fail-slow, not fail-slows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable

from .errors import SimulationError


@dataclass(frozen=True)
class SlowClass:
    """One kind of fail-slow: how often a device starts one, how long it lasts, how much slower it makes its node."""

    name: str
    rate_per_device_hour: float  # onsets per device-hour while this class is not active on the node
    mean_duration_h: float | None  # exponential mean; None: the node stays slow
    factors: tuple[float, ...]  # compute slowdown (time multiplier >= 1), drawn uniformly per episode
    source: str = ""

    def __post_init__(self) -> None:
        where = f"fail-slow class {self.name!r}"
        r = self.rate_per_device_hour
        if not _number(r) or not math.isfinite(r) or r < 0:
            raise SimulationError(f"{where}: rate_per_device_hour must be a finite number >= 0, got {r!r}")
        d = self.mean_duration_h
        if d is not None and (not _number(d) or not d > 0 or not math.isfinite(d)):
            raise SimulationError(f"{where}: mean_duration_h must be a positive number of hours, or None for "
                                  f"a node that stays slow, got {d!r}")
        factors = tuple(self.factors) if isinstance(self.factors, Iterable) else ()
        if not factors:
            raise SimulationError(f"{where}: factors must list at least one slowdown factor, got {self.factors!r}")
        bad = [f for f in factors if not _number(f) or not math.isfinite(f) or f < 1]
        if bad:
            raise SimulationError(f"{where}: factors must be >= 1 (how many times longer the node's operations "
                                  f"take), got {bad[0]!r}")
        object.__setattr__(self, "factors", tuple(float(f) for f in factors))

    def scaled(self, k: float) -> "SlowClass":
        """The same class with its rate multiplied by ``k`` (a stress setting)."""
        return replace(self, name=f"{self.name} x{k:g}", rate_per_device_hour=self.rate_per_device_hour * k)


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


GREYHOUND = "Greyhound (USENIX ATC '25) / FALCON (arXiv 2410.12588) §3"
COMPUTE = SlowClass("compute", 6 / (392 * 4 * 80 / 60), 10 / 60, (1.2, 1 / (1 - 0.216)),
                    f"{GREYHOUND}: 6 of 392 single-node jobs, 4 GPUs, 70-90 min; mean 10 min; 20% / 21.6% slower")
COMMUNICATION = SlowClass("communication", 42 / (107 * 8 * 5), 24 / 60, (0.57 / 0.41, 0.57 / 0.31),
                          f"{GREYHOUND}: 42 of 107 four-node jobs, 8 GPUs, ~5 h; mean 24 min; 0.57->0.41->0.31 it/s")
AT_SCALE = SlowClass("at-scale", COMMUNICATION.rate_per_device_hour, 72 / 60, (5.0, 1 / 0.15, 10.0),
                     f"{GREYHOUND}: 512-1024-GPU jobs, mean 72 min, throughput -80% / -85% / to 10%; "
                     "rate: the communication class's (our assumption)")

FAIL_SLOW_PRESETS: dict[str, tuple[SlowClass, ...]] = {
    "none": (),
    "greyhound": (COMPUTE, COMMUNICATION),
    "greyhound-x10": (COMPUTE.scaled(10), COMMUNICATION.scaled(10)),
    "greyhound-severe": (AT_SCALE,),
}


def resolve_fail_slow(spec: str | Iterable[SlowClass] | None) -> tuple[SlowClass, ...]:
    """A preset name, a sequence of classes, or None -> the classes (validated)."""
    if spec is None:
        return ()
    if isinstance(spec, str):
        if spec not in FAIL_SLOW_PRESETS:
            raise SimulationError(f"--fail-slow {spec}: unknown; choose from {', '.join(FAIL_SLOW_PRESETS)}")
        return FAIL_SLOW_PRESETS[spec]
    classes = tuple(spec)
    bad = [c for c in classes if not isinstance(c, SlowClass)]
    if bad:
        raise SimulationError(f"fail_slow must be a preset name or SlowClass objects, got {bad[0]!r}")
    return classes


def describe(classes: Iterable[SlowClass]) -> str:
    """One line per class, for tables and reports."""
    out = []
    for c in classes:
        dur = "stays slow" if c.mean_duration_h is None else f"mean {60 * c.mean_duration_h:.0f} min"
        out.append(f"{c.name}: {c.rate_per_device_hour:.4f}/device-h, {dur}, factors "
                   + "/".join(f"{f:.2f}" for f in c.factors))
    return "; ".join(out)
