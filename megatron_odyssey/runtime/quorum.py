"""Which side of a network partition may go on training: never both (no split brain).

A standby takes over when the agent's machine is silent. Silence does not say whether that machine lost power
(nothing runs there) or was cut off from the others while it runs on (its agent, and its ranks, too). In the second
case, without this rule, both agents recover with the ranks they still reach, and where each side holds a full copy
of the model both train on: two copies of one job, each writing checkpoints and the report.

The rule, after an agent and its standby lost each other silently (a machine that refuses the connection has lost
the process, not the network: its agent can never come back, and no rule is needed):

- the agent starts a new generation only with **more than half** of the ranks of the generation its standby last
  received (the reference); otherwise it steps down;
- the standby, once it has taken over and sealed the survivors, goes on only with **at least half** of the same
  reference; otherwise it steps down, and withdraws its takeover so the agent is not deposed when the network mends.

A rank is with one of them at a time: it moves to the standby only after its agent failed it, and never back.
So the two sides' ranks are disjoint, more than half and at least half of one set cannot both hold, and ties (a
two-machine job cut in two) go to the standby: the agent's machine is the one whose loss the standby exists for.
The reference is the last generation written ahead to the standby; where that write itself failed, the standby
may or may not hold it, and the agent needs a majority of both (:attr:`Quorum.references`).

The price: a job of two machines whose standby's machine loses power (silent, not refused) stops, restarting from
its last checkpoint, since its agent cannot tell that loss from being cut off itself (etcd, behind
``torch.distributed.elastic``'s etcd rendezvous, has the same limit: of two voters, neither is a majority alone).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

GONE = "gone"  # the peer's machine refused the connection: its process is gone, its machine answers
SILENT = "silent"  # nothing answered: lost power, or a partition (one side or the other is cut off)


class NoQuorum(RuntimeError):
    """This side of a partition holds too few of the job's ranks to go on: it steps down."""


def agent_may_go_on(ranks: Iterable[int], reference: frozenset[int]) -> bool:
    """The agent's side: strictly more than half of ``reference``."""
    return 2 * len(set(ranks) & reference) > len(reference)


def standby_may_go_on(ranks: Iterable[int], reference: frozenset[int]) -> bool:
    """The standby's side: at least half of ``reference`` (ties are the standby's)."""
    return 2 * len(set(ranks) & reference) >= len(reference)


@dataclass(frozen=True)
class Quorum:
    """An agent that lost a silent standby: the ranks it must hold a majority of, in every generation it starts."""

    references: tuple[frozenset[int], ...]  # the last generation the standby acknowledged (and the one it may hold)

    def check(self, ranks: Iterable[int]) -> None:
        """NoQuorum, saying whom this agent still has, unless it may start a generation of ``ranks``."""
        ranks = set(ranks)
        for reference in self.references:
            if not agent_may_go_on(ranks, reference):
                held = sorted(ranks & reference)
                raise NoQuorum(f"this agent holds {len(held)} of the job's {len(reference)} ranks ({held}) and its "
                               f"standby's machine is silent: this machine is the one cut off (the standby takes the "
                               f"job over with the others, at least half of them), so it steps down rather than train "
                               f"a second copy of the job")


def standby_check(ranks: Iterable[int], reference: frozenset[int]) -> None:
    """NoQuorum unless a standby that took over from a silent agent may go on with ``ranks``."""
    ranks = set(ranks)
    if not standby_may_go_on(ranks, reference):
        held = sorted(ranks & reference)
        raise NoQuorum(f"the standby took over from a silent agent, but only {len(held)} of the job's "
                       f"{len(reference)} ranks ({held}) came to it: this machine is the one cut off (the agent goes "
                       f"on with the others), so the standby withdraws rather than train a second copy of the job")
