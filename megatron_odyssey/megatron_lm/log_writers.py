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
the rank that was last finishes the run while the new one resumes it; the order of the two is not arranged (the
store could order them; unchecked without a W&B service). A machine that comes back sets Megatron up in a
private world of its own, where it would be the last rank: its writers' flags are withheld there (:func:`withhold`)
and given back at its admission, before it enters the job's generation.
"""
from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass
from typing import Any, Iterator

#: the store key of the W&B run the job logs to, for whichever rank is last after a failure
WANDB_RUN_KEY = "odyssey/wandb/run"


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


def follow_the_last_rank(args: Any, store: Any) -> None:
    """Call once the new generation's world is up (``torch.distributed`` is the survivors'), and at start-up (the
    launch's last rank publishes its W&B run)."""
    wanted = [w for w in WRITERS if getattr(args, w.flag, None)]
    if not wanted:
        return
    from megatron.training import global_vars
    from megatron.training.utils import is_last_rank

    last = is_last_rank()
    for w in wanted:
        writer = getattr(global_vars, w.variable)
        if last and writer is None:
            with _resuming(w, store):
                w.open_as_last(global_vars, args)
        elif not last and writer is not None:
            w.shut(global_vars, writer)
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
