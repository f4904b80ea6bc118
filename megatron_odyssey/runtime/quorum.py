"""Which side of a network partition may go on training: never both (no split brain).

A standby takes over when the agent's machine is silent. Silence does not say whether that machine lost power
(nothing runs there) or was cut off from the others while it runs on (its agent, and its ranks, too). In the second
case, without this rule, both agents recover with the ranks they still reach, and where each side holds a full copy
of the model both train on: two copies of one job, each writing checkpoints and the report.

The rule, after an agent and its standby lost each other in a way that leaves the other side possibly running:

- the agent starts a new generation only with **more than half** of the ranks of the generation its standby last
  received (the reference); otherwise it steps down;
- the standby, once it has taken over and sealed the survivors, goes on only with **at least half** of the same
  reference; otherwise it steps down, and withdraws its takeover so the agent is not deposed when the network mends.

When does the other side possibly run? Where it went **silent** (nothing answered), always: lost power, or a cut
that drops packets (a failed link, switch port or cloud security group). Where it **refused** the connection, its
process is usually gone (its machine answers, nothing listens), but a firewall between the two machines that
*rejects* (a reset, as a closed port answers) looks the same from either side. So:

- the standby applies its rule whichever way it lost the agent (it costs nothing: when the agent's process is
  gone, every rank that lived comes to the standby, all but those of the agent's machine);
- the agent applies its rule after a refusal only where the standby could hold half of a reference: its other
  machines' ranks are asked whether they reach the standby's store (``Agent._standby_may_live``), and only ranks of
  machines that reach it or do not answer could be on its side (a rank moves to the standby only once it lost
  this agent). A standby's machine lost with its ranks in a job of three machines or more leaves too few for that,
  and the job goes on as before. In a job of **two** machines it does not: there, with a witness, the tie goes to
  whoever claims it (a standby that is gone claims nothing); without one, the refusal is taken for the loss it
  almost always is, and a rejecting firewall between the two machines would let both sides go on (said on the
  terminal when it happens; ``--witness-dir`` closes it).

A rank is with one of them at a time: it moves to the standby only after its agent failed it, and never back.
So the two sides' ranks are disjoint, more than half and at least half of one set cannot both hold, and ties (a
two-machine job cut in two) go to the standby: the agent's machine is the one whose loss the standby exists for.
The reference is the last generation written ahead to the standby; where that write itself failed, the standby
may or may not hold it, and the agent needs a majority of both (:attr:`Quorum.references`).

The price: a job of two machines whose standby's machine loses power (silent, not refused) stops, restarting from
its last checkpoint, since its agent cannot tell that loss from being cut off itself (etcd, behind
``torch.distributed.elastic``'s etcd rendezvous, has the same limit: of two voters, neither is a majority alone).

A **witness** lifts it (``odyssey-launch --witness-dir``, as a failover cluster's file-share witness does): a directory
on storage both the agent's machine and the standby's reach, such as the checkpoints' shared file system. It breaks
ties only, so a majority goes on as before: a side holding exactly half of the reference goes on where it claims the
witness for that reference first (an exclusive create, atomic on local and network file systems), and steps down
where the other side did or the storage does not answer. With one vote more than the ranks, more than half of the
votes still cannot be on both sides. The job asks for a witness only once per such loss (neither side has a standby
afterwards), so a claim is named by the reference's ranks, under a directory of the job's own (:meth:`Witness.create`).
"""
from __future__ import annotations

import os
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

GONE = "gone"  # the peer's machine refused the connection: its process is gone (or a firewall rejects)
SILENT = "silent"  # nothing answered: lost power, or a partition (one side or the other is cut off)


class NoQuorum(RuntimeError):
    """This side of a partition holds too few of the job's ranks to go on: it steps down."""


class WitnessNotShared(ValueError):
    """The standby's machine does not see the witness directory the agent's machine made: it is not shared."""


@dataclass(frozen=True)
class Witness:
    """A job's directory on storage both sides of a partition may reach: whoever claims a reference there first
    takes its tie (``holder`` says who, in the claim)."""

    directory: Path
    holder: str

    @staticmethod
    def create(root: str | Path, holder: str) -> "Witness":
        """The agent's machine, at the job's start: a directory of this job's own under ``root``."""
        directory = Path(root) / f"odyssey-witness-{uuid.uuid4().hex}"
        directory.mkdir()
        return Witness(directory, holder)

    @staticmethod
    def join(directory: str | Path, holder: str) -> "Witness":
        """The standby's machine: the agent's directory, which it must see (WitnessNotShared, naming the flag)."""
        directory = Path(directory)
        if not directory.is_dir():
            raise WitnessNotShared(f"--witness-dir: the standby's machine does not see {directory}, which the agent's "
                                   f"machine made: the witness must be a directory both machines share (the same "
                                   f"path on a network file system, e.g. the checkpoints')")
        return Witness(directory, holder)

    def claim(self, reference: frozenset[int]) -> bool:
        """Whether this side holds the witness for ``reference``: it claimed it now, or before. The claim is written
        aside and linked into place, so it appears whole or not at all; storage that does not answer is a claim
        lost (the other side may hold it)."""
        name = self._claim(reference)
        aside = self.directory / f".{name.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            aside.write_text(self.holder)
            try:
                os.link(aside, name)
                return True
            except FileExistsError:
                return name.read_text() == self.holder
            finally:
                aside.unlink(missing_ok=True)
        except OSError:
            return False

    def remove(self) -> None:
        """The job ended (whoever ran it to its end): its directory goes where it is empty; a claim stays, saying
        which side of a partition trained on, for whoever looks into the job afterwards."""
        try:
            self.directory.rmdir()
        except OSError:
            pass

    def holder_of(self, reference: frozenset[int]) -> str | None:
        """Who claimed ``reference`` (None: nobody, or the storage does not answer)."""
        try:
            return self._claim(reference).read_text()
        except OSError:
            return None

    def _claim(self, reference: frozenset[int]) -> Path:
        return self.directory / ("ranks-" + "_".join(map(str, sorted(reference))))


def agent_may_go_on(ranks: Iterable[int], reference: frozenset[int], witness: Witness | None = None) -> bool:
    """The agent's side: strictly more than half of ``reference``, or exactly half and the witness."""
    held = 2 * len(set(ranks) & reference)
    return held > len(reference) or (held == len(reference) and witness is not None and witness.claim(reference))


def standby_may_go_on(ranks: Iterable[int], reference: frozenset[int], witness: Witness | None = None) -> bool:
    """The standby's side: more than half of ``reference``, or exactly half and (the job has one) the witness;
    without a witness ties are the standby's."""
    held = 2 * len(set(ranks) & reference)
    return held > len(reference) or (held == len(reference) and (witness is None or witness.claim(reference)))


def _tie_lost(witness: Witness | None, reference: frozenset[int]) -> str:
    """Why a side holding exactly half did not go on, where the job has a witness."""
    if witness is None:
        return ""
    other = witness.holder_of(reference)
    return (f"; the witness in {witness.directory} was claimed first by the {other}" if other else
            f"; the witness in {witness.directory} could not be claimed (the storage did not answer)")


@dataclass(frozen=True)
class Quorum:
    """An agent that lost a silent standby: the ranks it must hold a majority of, in every generation it starts."""

    references: tuple[frozenset[int], ...]  # the last generation the standby acknowledged (and the one it may hold)
    witness: Witness | None = None  # (odyssey-launch --witness-dir) who takes a tie
    lost_as: str = SILENT  # how the standby was lost (GONE: refused, though it may run on)

    def check(self, ranks: Iterable[int]) -> None:
        """NoQuorum, saying whom this agent still has, unless it may start a generation of ``ranks``."""
        ranks = set(ranks)
        for reference in self.references:
            if not agent_may_go_on(ranks, reference, self.witness):
                held = sorted(ranks & reference)
                tied = 2 * len(held) == len(reference)
                tie = _tie_lost(self.witness, reference) if tied else ""
                lift = ("; a tie is the standby's unless odyssey-launch --witness-dir names a directory both machines "
                        "share, which goes to the side that claims it first: with one, a standby's machine that lost "
                        "power does not stop the job" if tied and self.witness is None else "")
                lost = "is silent" if self.lost_as == SILENT else "refused the connection, though it may run on"
                raise NoQuorum(f"this agent holds {len(held)} of the job's {len(reference)} ranks ({held}) and its "
                               f"standby's machine {lost}{tie}: this machine is the one cut off (the standby "
                               f"takes the job over with the others, at least half of them), so it steps down rather "
                               f"than train a second copy of the job{lift}")


def standby_check(ranks: Iterable[int], reference: frozenset[int], witness: Witness | None = None,
                  lost_as: str = SILENT) -> None:
    """NoQuorum unless a standby that took over from an agent lost ``lost_as`` may go on with ``ranks``."""
    ranks = set(ranks)
    if not standby_may_go_on(ranks, reference, witness):
        held = sorted(ranks & reference)
        tie = _tie_lost(witness, reference) if 2 * len(held) == len(reference) else ""
        agent = "a silent agent" if lost_as == SILENT else "an agent whose machine refused the connection"
        raise NoQuorum(f"the standby took over from {agent}, but only {len(held)} of the job's "
                       f"{len(reference)} ranks ({held}) came to it{tie}: this machine is the one cut off (the agent "
                       f"goes on with the others), so the standby withdraws rather than train a second copy of the job")
