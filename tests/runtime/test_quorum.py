"""Which side of a partition goes on (``runtime.quorum``): never both, exactly one of two clean halves, ties to the
standby; checked against every way to split a small job's ranks. The agent and the standby on real stores are in
``test_silent_machine.py``; whole Megatron-LM jobs cut in two in ``test_megatron_lm.py``."""
from __future__ import annotations

from itertools import combinations, product

import pytest

from megatron_odyssey.runtime.quorum import NoQuorum, Quorum, agent_may_go_on, standby_check, standby_may_go_on

RANKS = range(5)
SUBSETS = [frozenset(c) for k in range(1, len(RANKS) + 1) for c in combinations(RANKS, k)]


def test_never_both_sides_whatever_the_split_and_whichever_generation_the_standby_holds() -> None:
    """Every assignment of 5 ranks to the agent, the standby or neither (a rank is with one side at a time), every
    generation the standby last acknowledged, and every one a failed write may or may not have brought it: the agent
    needs a majority of both, so it never goes on beside a standby that goes on."""
    both = []
    for acknowledged, attempted in product(SUBSETS, SUBSETS):
        agent_quorum = Quorum((acknowledged, attempted))
        for sides in product("asn", repeat=len(RANKS)):
            agent = {r for r, side in zip(RANKS, sides) if side == "a"}
            standby = {r for r, side in zip(RANKS, sides) if side == "s"}
            try:
                agent_quorum.check(agent)
            except NoQuorum:
                continue
            both += [(acknowledged, attempted, sides) for held in (acknowledged, attempted)
                     if standby_may_go_on(standby, held)]
    assert both == []


def test_a_clean_cut_in_two_lets_exactly_one_side_go_on() -> None:
    """A partition that leaves every rank with one side or the other: one of them trains on (the job is not lost for
    want of a rule), ties included."""
    for reference in SUBSETS:
        for k in range(len(reference) + 1):
            for agent in map(set, combinations(sorted(reference), k)):
                standby = reference - agent
                assert agent_may_go_on(agent, reference) != standby_may_go_on(standby, reference), (agent, standby)


@pytest.mark.parametrize("agent, standby, goes_on", [
    ({0}, {1, 2, 3}, "standby"),  # machine 0 (the agent's) cut off
    ({0, 2, 3}, {1}, "agent"),  # machine 1 (the standby's) cut off
    ({0, 1}, {2, 3}, "standby"),  # cut in two halves: the tie is the standby's
    ({0}, {1}, "standby"),  # two machines: the standby's machine's power loss is not told from a cut: the standby's
])
def test_four_and_two_machines_by_hand(agent: set[int], standby: set[int], goes_on: str) -> None:
    reference = frozenset(agent | standby)
    assert agent_may_go_on(agent, reference) == (goes_on == "agent")
    assert standby_may_go_on(standby, reference) == (goes_on == "standby")


def test_the_ranks_outside_the_reference_do_not_count() -> None:
    """Ranks that joined after the standby's last generation (or were never in it) make no majority."""
    assert not agent_may_go_on({0, 7, 8, 9}, frozenset({0, 1, 2}))
    assert not standby_may_go_on({7, 8, 9}, frozenset({0, 1, 2}))


def test_the_step_downs_say_whom_each_side_holds() -> None:
    with pytest.raises(NoQuorum, match=r"this agent holds 1 of the job's 4 ranks \(\[0\]\) and its standby's machine "
                                       r"is silent: this machine is the one cut off"):
        Quorum((frozenset(range(4)),)).check({0})
    both = Quorum((frozenset(range(5)), frozenset({2, 3, 4})))  # (a failed write: the standby may hold either)
    with pytest.raises(NoQuorum, match=r"holds 1 of the job's 3 ranks \(\[2\]\)"):  # (a majority of one is not enough)
        both.check({0, 1, 2})
    both.check({0, 2, 3})
    with pytest.raises(NoQuorum, match=r"only 1 of the job's 4 ranks \(\[1\]\) came to it: this machine is the one "
                                       r"cut off"):
        standby_check({1}, frozenset(range(4)))
    standby_check({2, 3}, frozenset(range(4)))
