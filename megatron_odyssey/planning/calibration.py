"""Scale an analytic profile's compute times so the estimator reproduces a measured step.

Megatron's timers see a whole forward-backward (every micro-batch of the pipeline schedule plus the
data-parallel gradient reduction at its end), not each layer. The analytic profile gets the relative
costs of units right (FLOPs); one factor on every unit's forward and backward time, found so the
estimated symmetric step (Eq. 11 pipeline time + gradient sync) equals the measurement, gets the
absolute scale right. Communication and memory terms are left as they are.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .errors import PlanningError
from .estimator import estimate_step
from .plan import ExecutionPlan
from .profile import ModelProfile

MIN_COMPUTE_SHARE = 0.5  # a sync estimate above half the measurement is not trusted to explain it


@dataclass(frozen=True)
class Calibration:
    profile: ModelProfile
    factor: float  # measured compute / analytic compute
    measured_s: float
    target_compute_s: float  # what the pipeline schedule is fitted to (measured minus estimated sync)


def scale_compute(profile: ModelProfile, factor: float, name: str | None = None) -> ModelProfile:
    units = [replace(u, forward_s=u.forward_s * factor, backward_s=u.backward_s * factor) for u in profile.units()]
    return replace(profile, embedding=units[0], layers=tuple(units[1:-1]), output=units[-1],
                   name=name or profile.name)


def calibrate(profile: ModelProfile, plan: ExecutionPlan, measured_s: float, *, includes_sync: bool = True,
              name: str = "measured", rel_tol: float = 1e-9) -> Calibration:
    """The profile whose estimated pipeline time for ``plan`` (+ its gradient sync when the measurement
    includes it) equals ``measured_s``. The pipeline time is piecewise linear and increasing in the
    factor (p2p terms do not scale), so a secant iteration from the analytic point converges in a few
    steps."""
    if not measured_s > 0:
        raise PlanningError(f"measured step time must be > 0, got {measured_s}")
    base = estimate_step(plan, profile)
    target = measured_s
    if includes_sync:
        target = max(measured_s - base.sync_s, MIN_COMPUTE_SHARE * measured_s)

    def compute(k: float) -> float:
        return estimate_step(plan, scale_compute(profile, k)).compute_s

    k0, t0 = 0.0, compute(0.0)  # communication only
    if target <= t0:  # the measurement is below the communication the profile assumes: keep relative costs
        k = target / base.compute_s
    else:
        k1, t1 = 1.0, base.compute_s
        for _ in range(50):
            if abs(t1 - target) <= rel_tol * target or t1 == t0:
                break
            k0, t0, k1 = k1, t1, k1 + (target - t1) * (k1 - k0) / (t1 - t0)
            t1 = compute(k1)
        k = k1
    return Calibration(scale_compute(profile, k, name), k, measured_s, target)
