"""When the planner's drop of a slow node is carried out: once every other rank is inside the next step.

The agent decides a drop when it commits a step. The ranks are then between two of the host's iterations
(Megatron-LM's ``training_log``, a checkpoint save, the exit check), each at its own pace. A fence landing there is
met in calls that the faster survivors have already left for the next step, and a rank still in one cannot run it
again: its collectives would wait for them (``megatron_lm.between_steps``; on Megatron-LM main the logging rank's
line of that iteration was lost so). Inside a step every failure is recovered exactly. So the slow ranks are fenced
only once each survivor has said it entered the next step:

- the commit that decided the drop carries that step (:func:`commit_value`), and so does the plan of any generation
  started while the drop waits (``say_inside`` in the plan message);
- each rank, at its first operation of that step or a later one, sets its key (:func:`inside_key`);
- every member ready for that step or a later one counts too: its work is done everywhere. The agent fences then,
  instead of committing it; the recovery commits it first. (Ranks of a staggered plan may have gone on to the next
  step's work by then; only hosts without collectives between steps run such plans: Megatron-LM's offers none);
- a survivor that does not get there within ``bound_s`` (a checkpoint save longer than the bound) is not waited for
  longer: the drop is carried out then, and the survivors redo what it interrupted;
- if the job ends first (a rank, the slow ones included, left it with 0: the script's own exit), or the slow ranks
  fail meanwhile, the drop is not taken, and the report says why;
- a waiting drop is written ahead to the standby agent with the step's commit that decided it (and with every later
  commit and generation), so a standby that takes over meanwhile carries it out (:meth:`PendingDrop.to_json`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: what a commit's value says after the loss when the agent waits for the ranks inside the next step
INSIDE = " inside "


def commit_value(loss: float, inside: int | None = None) -> str:
    """The value of a step's commit key: its loss, then the step each rank must say it entered, if any."""
    return repr(loss) if inside is None else f"{loss!r}{INSIDE}{inside}"


def parse_commit(value: bytes | str) -> tuple[float, int | None]:
    """(loss, the step to say this rank is inside, or None) from a commit key's value."""
    text = value.decode() if isinstance(value, bytes) else value
    loss, _, inside = text.partition(INSIDE)
    return float(loss), (int(inside) if inside else None)


def inside_key(gen: int, step: int, ident: int) -> str:
    """Set by rank ``ident`` once it is inside ``step`` (or a later one) of generation ``gen``."""
    return f"odyssey/gen{gen}/inside/{step}/{ident}"


@dataclass
class PendingDrop:
    """A drop decided but not yet carried out: ``action`` (``slow_nodes.Action``) waits for the ranks of
    generation ``gen`` to be inside ``step``."""

    action: Any
    gen: int
    step: int
    decided: float  # when the drop was decided (time.time())
    bound_s: float
    since: float = 0.0  # when the wait for this generation's ranks began (the bound counts from it)

    def __post_init__(self) -> None:
        self.since = self.since or self.decided

    def rearm(self, gen: int, step: int, now: float) -> None:
        """A new generation started while the drop waited (a recovery, a takeover): its ranks are told ``step`` by
        its plan, and get the whole bound again (a recovery longer than the bound must not fence them at once,
        between two steps)."""
        self.gen, self.step, self.since = gen, step, now

    def due(self, store: Any, survivors: list[int], now: float) -> str | None:
        """Why the drop is carried out now, or None to wait."""
        if not survivors or store.check([inside_key(self.gen, self.step, i) for i in survivors]):
            return f"every other rank is inside step {self.step}"
        if now - self.since >= self.bound_s:
            missing = [i for i in survivors if not store.check([inside_key(self.gen, self.step, i)])]
            return (f"rank(s) {missing} did not reach step {self.step} within {self.bound_s:g} s (the hard timeout): "
                    f"not waited for longer")
        return None

    def when(self, why: str, now: float) -> str:
        """The report's words for when the drop was carried out."""
        return f"fenced {now - self.decided:.2f} s after the decision: {why}"

    def to_json(self) -> dict[str, Any]:
        """The wait, for the standby agent (the action's ranks and report entry are the agent's to add)."""
        return {"gen": self.gen, "step": self.step, "decided": self.decided, "bound_s": self.bound_s}

    @classmethod
    def from_json(cls, spec: dict[str, Any], action: Any, now: float) -> "PendingDrop":
        """A standby's copy of the lost agent's wait; its bound starts again at ``now`` (the takeover)."""
        return cls(action, int(spec["gen"]), int(spec["step"]), float(spec["decided"]), float(spec["bound_s"]), now)
