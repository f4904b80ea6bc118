"""Which side of a partition goes on (``runtime.quorum``): never both, exactly one of two clean halves, ties to the
standby, or with a witness to the side that claims it first; checked against every way to split a small job's ranks. The agent and the standby on real stores are in
``test_silent_machine.py``; whole Megatron-LM jobs cut in two in ``test_megatron_lm.py``."""
from __future__ import annotations

import multiprocessing
from itertools import combinations, product
from pathlib import Path

import pytest

from megatron_odyssey.runtime.quorum import (GONE, NoQuorum, Quorum, Witness, WitnessNotShared, agent_may_go_on,
                                             standby_check, standby_may_go_on)

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
    with pytest.raises(NoQuorum, match=r"holds 1 of the job's 2 ranks \(\[0\]\) .* second copy of the job; a tie is "
                                       r"the standby's unless odyssey-launch --witness-dir names a directory both "
                                       r"machines share"):
        Quorum((frozenset({0, 1}),)).check({0})
    both = Quorum((frozenset(range(5)), frozenset({2, 3, 4})))  # (a failed write: the standby may hold either)
    with pytest.raises(NoQuorum, match=r"holds 1 of the job's 3 ranks \(\[2\]\)"):  # (a majority of one is not enough)
        both.check({0, 1, 2})
    both.check({0, 2, 3})
    with pytest.raises(NoQuorum, match=r"only 1 of the job's 4 ranks \(\[1\]\) came to it: this machine is the one "
                                       r"cut off"):
        standby_check({1}, frozenset(range(4)))
    standby_check({2, 3}, frozenset(range(4)))
    # a refusal, which a firewall that rejects gives too (the other side may run on)
    with pytest.raises(NoQuorum, match=r"this agent holds 2 of the job's 4 ranks \(\[0, 1\]\) and its standby's "
                                       r"machine refused the connection, though it may run on: this machine is the "
                                       r"one cut off"):
        Quorum((frozenset(range(4)),), lost_as=GONE).check({0, 1})
    with pytest.raises(NoQuorum, match=r"the standby took over from an agent whose machine refused the connection, "
                                       r"but only 1 of the job's 4 ranks \(\[1\]\) came to it"):
        standby_check({1}, frozenset(range(4)), lost_as=GONE)


def _sides(directory: Path) -> tuple[Witness, Witness]:
    """The agent's and the standby's view of one job's witness directory."""
    agent = Witness.create(directory, "agent on machine 0")
    return agent, Witness.join(agent.directory, "standby on machine 1")


def test_with_a_witness_never_both_sides_whichever_claims_first(tmp_path: Path) -> None:
    """As above, with a witness (4 ranks; each case a fresh directory), the agent checking first or the standby:
    a tie goes to the first claimant, and never to both. The references are those of an even size, the only ones a
    tie can split (the witness is asked nothing otherwise: the test above)."""
    subsets = [frozenset(c) for k in (2, 4) for c in combinations(range(4), k)]
    both, cases = [], 0
    for acknowledged, attempted in product(subsets, subsets):
        for sides in product("asn", repeat=4):
            agent = {r for r, side in zip(range(4), sides) if side == "a"}
            standby = {r for r, side in zip(range(4), sides) if side == "s"}
            for held in {acknowledged, attempted}:
                if 2 * len(standby & held) != len(held) and all(2 * len(agent & r) != len(r)
                                                               for r in (acknowledged, attempted)):
                    continue  # (no tie on either side: the witness is not asked, and the test above holds)
                for agent_first in (True, False):
                    a, s = _sides(tmp_path)
                    quorum = Quorum((acknowledged, attempted), a)
                    outcome = {}
                    for side in (("a", "s") if agent_first else ("s", "a")):
                        if side == "a":
                            try:
                                quorum.check(agent)
                                outcome["a"] = True
                            except NoQuorum:
                                outcome["a"] = False
                        else:
                            outcome["s"] = standby_may_go_on(standby, held, s)
                    cases += 1
                    if outcome["a"] and outcome["s"]:
                        both.append((acknowledged, attempted, sides, agent_first))
    assert both == [] and cases > 5_000


def test_with_a_witness_a_clean_cut_in_two_lets_exactly_the_first_claimant_of_a_tie_go_on(tmp_path: Path) -> None:
    """Two halves: whichever claims first goes on (a two-machine job whose machine 1 lost power: the agent, the only
    one left to claim); an unequal cut is decided by the majority, as without a witness, whoever asks first."""
    for reference in (frozenset({0, 1}), frozenset(range(4)), frozenset(range(6))):
        for k in range(len(reference) + 1):
            for agent in map(set, combinations(sorted(reference), k)):
                standby = reference - agent
                for agent_first in (True, False):
                    a, s = _sides(tmp_path)
                    if agent_first:
                        went = (agent_may_go_on(agent, reference, a), standby_may_go_on(standby, reference, s))
                    else:
                        went = tuple(reversed((standby_may_go_on(standby, reference, s),
                                               agent_may_go_on(agent, reference, a))))
                    assert sum(went) == 1, (agent, standby, agent_first)
                    if 2 * len(agent) == len(reference):
                        assert went == ((True, False) if agent_first else (False, True))
    a, _ = _sides(tmp_path)
    assert agent_may_go_on({0}, frozenset({0, 1}), a)  # (machine 1 lost power: nobody else claims)


def test_a_claim_is_the_first_claimants_and_says_who(tmp_path: Path) -> None:
    a, s = _sides(tmp_path)
    reference = frozenset({0, 1, 2, 3})
    assert s.claim(reference) and s.claim(reference)  # (asked again: still the standby's)
    assert not a.claim(reference) and s.holder_of(reference) == "standby on machine 1"
    assert a.claim(frozenset({0, 1})) and a.holder_of(frozenset({2, 3})) is None
    assert sorted(p.name for p in a.directory.iterdir()) == ["ranks-0_1", "ranks-0_1_2_3"]  # (nothing left aside)
    a.remove()  # (the job's end keeps what was claimed; an empty directory goes)
    assert s.holder_of(reference) == "standby on machine 1"
    unused, _ = _sides(tmp_path)
    unused.remove()
    assert not unused.directory.exists()
    with pytest.raises(NoQuorum, match=r"holds 2 of the job's 4 ranks \(\[0, 1\]\) and its standby's machine is "
                                       r"silent; the witness in .* was claimed first by the standby on machine 1"):
        Quorum((reference,), a).check({0, 1})
    with pytest.raises(NoQuorum, match=r"only 1 of the job's 2 ranks \(\[1\]\) came to it; the witness in .* was "
                                       r"claimed first by the agent on machine 0"):
        standby_check({1}, frozenset({0, 1}), s)


def test_storage_that_does_not_answer_is_a_claim_lost_and_an_unshared_directory_is_refused(tmp_path: Path) -> None:
    a, s = _sides(tmp_path)
    for entry in a.directory.iterdir():
        entry.unlink()
    a.directory.rmdir()  # (as a mount gone away)
    assert not a.claim(frozenset({0, 1})) and not standby_may_go_on({1}, frozenset({0, 1}), s)
    with pytest.raises(NoQuorum, match=r"the witness in .* could not be claimed \(the storage did not answer\)"):
        Quorum((frozenset({0, 1}),), a).check({0})
    with pytest.raises(WitnessNotShared, match=r"--witness-dir: the standby's machine does not see .*: the witness "
                                               r"must be a directory both machines share"):
        Witness.join(tmp_path / "elsewhere", "standby on machine 1")


def _race(directories: list[str], holder: str, start, results) -> None:
    for directory in directories:
        start.wait()  # (every process at the line, then all claim at once)
        results.put((directory, holder, Witness(Path(directory), holder).claim(frozenset({0, 1}))))


def test_of_processes_racing_for_a_claim_exactly_one_wins(tmp_path: Path) -> None:
    """Four real processes claim one reference at once, 20 times: the exclusive link lets exactly one of them hold
    each claim, and the file names that one."""
    ctx = multiprocessing.get_context("spawn")
    witnesses = [Witness.create(tmp_path, "-") for _ in range(20)]
    start, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_race, args=([str(w.directory) for w in witnesses], f"side {i}", start, results))
             for i in range(4)]
    for p in procs:
        p.start()
    outcome: dict[str, dict[str, bool]] = {}
    for _ in range(4 * len(witnesses)):
        directory, holder, won = results.get(timeout=60)
        outcome.setdefault(directory, {})[holder] = won
    for p in procs:
        p.join(30)
    for w in witnesses:
        (winner,) = [h for h, won in outcome[str(w.directory)].items() if won]
        assert w.holder_of(frozenset({0, 1})) == winner, outcome[str(w.directory)]
