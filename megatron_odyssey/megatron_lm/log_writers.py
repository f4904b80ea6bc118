"""Megatron's TensorBoard and Weights & Biases writers follow the world's last rank through failures.

Megatron-LM opens both writers (``--tensorboard-dir``, ``--wandb-project``) at start-up on the launch's last rank
only (``global_vars._set_tensorboard_writer`` / ``_set_wandb_writer``: ``args.rank == args.world_size - 1``), and
``training_log`` writes the iteration's scalars wherever a writer exists; its log line comes from whichever rank is
last in the world now (``print_rank_last``). When the launch's last rank is lost, the log line moves to the new
last rank but the writers died with the old one: the curves stopped at the failure, silently.

After every recovery (and when a machine is taken back) the rank that is now last opens the writers, through
Megatron's own set-up functions, and a rank that no longer is last closes its own (a machine taken back may be
last now). TensorBoard reads every event file of its directory, so its curves go on. W&B resumes the job's run:
the launch's last rank puts its run's id in the job's store, and the next last rank opens W&B with that id and
``resume="allow"`` (through W&B's ``WANDB_RUN_ID`` and ``WANDB_RESUME``, which ``wandb.init`` reads where Megatron
passes neither), so one run holds the whole job; W&B keeps a resumed run's steps increasing and drops a step it
already has (an iteration the dead rank logged before it died). Where a machine taken back becomes the last rank,
the rank that was last is alive and finishes the run while the new one resumes it: the new one waits, through the
store, until every other member of the generation has shut its writers (:class:`HandOver`), so the run is never
open in two processes; the wait is bounded by half the soft progress timeout, so it never looks like a stall.
A machine that comes back sets Megatron up in a
private world of its own, where it would be the last rank: its writers' flags are withheld there (:func:`withhold`)
and given back at its admission, before it enters the job's generation.
"""
from __future__ import annotations

import contextlib
import copy
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterator

#: the store key of the W&B run the job logs to, for whichever rank is last after a failure
WANDB_RUN_KEY = "odyssey/wandb/run"
#: a member of generation {gen} other than the last rank has shut its writers (if it had any)
SETTLED_KEY = "odyssey/gen{gen}/writers-settled/{ident}"


@dataclass(frozen=True)
class _Writer:
    flag: str  # the argument that asks for it
    setup: str  # megatron.training.global_vars' function that opens it on the launch's last rank
    variable: str  # the global it sets
    close: tuple[str, ...]  # its methods that end it

    def open_as_last(self, global_vars: Any, args: Any) -> None:
        as_last = copy.copy(args)
        as_last.rank = as_last.world_size - 1  # what the set-up function tests
        getattr(global_vars, self.setup)(as_last)

    def shut(self, global_vars: Any, writer: Any) -> None:
        for method in self.close:
            getattr(writer, method)()
        setattr(global_vars, self.variable, None)


TENSORBOARD = _Writer("tensorboard_dir", "_set_tensorboard_writer", "_GLOBAL_TENSORBOARD_WRITER", ("flush", "close"))
WANDB = _Writer("wandb_project", "_set_wandb_writer", "_GLOBAL_WANDB_WRITER", ("finish",))
WRITERS = (TENSORBOARD, WANDB)


@dataclass(frozen=True)
class HandOver:
    """The generation being entered, as the W&B hand-over needs it: the new last rank resumes the job's run only
    once every other member (``members``: global idents) has shut its writers, since the member that was last may
    be alive and still finishing the run (a machine taken back became the last rank)."""
    gen: int
    ident: int  # this rank's
    members: tuple[int, ...]
    limit_s: float  # longest wait; past it the run is resumed anyway, with a warning

    def settled(self, store: Any) -> None:
        store.set(SETTLED_KEY.format(gen=self.gen, ident=self.ident), "1")

    def wait_for_the_others(self, store: Any) -> None:
        """Polls (``check``) rather than ``wait``: the rank's other threads share nothing with a blocked client."""
        keys = {i: SETTLED_KEY.format(gen=self.gen, ident=i) for i in self.members if i != self.ident}
        deadline = time.monotonic() + self.limit_s
        while not store.check(list(keys.values())):
            if time.monotonic() > deadline:
                late = [i for i, key in keys.items() if not store.check([key])]
                print(f"[odyssey rank {self.ident}] generation {self.gen}: rank(s) {late} did not shut their "
                      f"W&B writer within {self.limit_s:.0f} s; resuming the job's W&B run without waiting longer "
                      f"(it may be open twice for a while)", file=sys.stderr, flush=True)
                return
            time.sleep(0.05)


def follow_the_last_rank(args: Any, store: Any, hand_over: HandOver | None = None) -> None:
    """Call once the new generation's world is up (``torch.distributed`` is the survivors'), with its
    ``hand_over``, and at start-up without (the launch's last rank publishes its W&B run)."""
    wanted = [w for w in WRITERS if getattr(args, w.flag, None)]
    if not wanted:
        return
    from megatron.training import global_vars
    from megatron.training.utils import is_last_rank

    last = is_last_rank()
    for w in wanted:
        writer = getattr(global_vars, w.variable)
        if last and writer is None:
            if w is WANDB and hand_over is not None and store.check([WANDB_RUN_KEY]):
                hand_over.wait_for_the_others(store)
            with _resuming(w, store):
                w.open_as_last(global_vars, args)
        elif not last and writer is not None:
            w.shut(global_vars, writer)
    if hand_over is not None and not last:
        hand_over.settled(store)
    run = getattr(getattr(global_vars, WANDB.variable, None), "run", None)
    if last and getattr(run, "id", None) and not store.check([WANDB_RUN_KEY]):
        store.set(WANDB_RUN_KEY, str(run.id))


@contextlib.contextmanager
def _resuming(writer: _Writer, store: Any) -> Iterator[None]:
    """Opening W&B where the job's run was published: W&B's environment names that run and resumes it, for this
    call only (the launch's environment is put back after)."""
    if writer is not WANDB or not store.check([WANDB_RUN_KEY]):
        yield
        return
    wanted = {"WANDB_RUN_ID": store.get(WANDB_RUN_KEY).decode(), "WANDB_RESUME": "allow"}
    before = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def withhold(args: Any) -> dict[str, Any]:
    """Clear the writers' flags (a joining rank's private world, before Megatron opens writers); returns them."""
    withheld = {w.flag: getattr(args, w.flag, None) for w in WRITERS}
    for flag in withheld:
        setattr(args, flag, None)
    return withheld


def give_back(args: Any, withheld: dict[str, Any]) -> None:
    for flag, value in withheld.items():
        setattr(args, flag, value)
