"""The compared fault-tolerance policies, by the names ``odyssey simulate --policies`` takes."""
from __future__ import annotations

from typing import Callable

from .base import Policy, Reaction, SimContext
from .bounds import FaultScaledPolicy, IdealPolicy
from .checkpoint import CheckpointPolicy
from .odyssey import OdysseyPolicy
from .oobleck_policy import OobleckPolicy
from .recycle import RecyclePolicy

FACTORIES: dict[str, Callable[[SimContext], Policy]] = {
    "odyssey": OdysseyPolicy,
    "odyssey-f1": lambda ctx: OdysseyPolicy(ctx, "odyssey-f1", price_restart_risk=False, min_pipelines=2),
    "odyssey-nofill": lambda ctx: OdysseyPolicy(ctx, "odyssey-nofill", fill=False),
    "odyssey-ignore-slow": lambda ctx: OdysseyPolicy(ctx, "odyssey-ignore-slow", slow="ignore"),
    "odyssey-slow-as-failure": lambda ctx: OdysseyPolicy(ctx, "odyssey-slow-as-failure", slow="as-failure"),
    "oobleck": OobleckPolicy,
    "recycle": RecyclePolicy,
    "recycle-nofill": lambda ctx: RecyclePolicy(ctx, bubble_filling=False),
    "recycle-nostagger": lambda ctx: RecyclePolicy(ctx, staggered=False),
    "checkpoint": CheckpointPolicy,
    "fault-scaled": FaultScaledPolicy,
    "ideal": IdealPolicy,
}


def make_policy(name: str, ctx: SimContext) -> Policy:
    return FACTORIES[name](ctx)


__all__ = ["FACTORIES", "Policy", "Reaction", "SimContext", "make_policy"]
