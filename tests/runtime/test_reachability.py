"""Who reaches whom (``runtime.reachability``): the ranks' probes over real sockets and a real store, and the set the
agent keeps, checked against an exhaustive search on small graphs, of ranks and of machines."""
from __future__ import annotations

import itertools
import json
import random
import socket
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatron_odyssey.runtime.agent import free_port
from megatron_odyssey.runtime.reachability import (ADDRESS_KEY, ANSWER_KEY, ASK_KEY, Prober, complete, kept, machines,
                                                   probe)
from megatron_odyssey.runtime.sockets import route_address
from megatron_odyssey.testing.network_namespace import silent_address


def _exhaustive(reach: dict[int, set[int]]) -> list[int]:
    """The largest set whose members all reach each other both ways; ties: the lowest ranks (sorted lists compare)."""
    ranks = sorted(reach)
    for size in range(len(ranks), 0, -1):
        found = [list(c) for c in itertools.combinations(ranks, size)
                 if all(b in reach[a] and a in reach[b] for a, b in itertools.combinations(c, 2))]
        if found:
            return min(found)
    return []


def test_the_kept_ranks_are_the_largest_set_that_all_reach_each_other() -> None:
    # machines 2 and 3 no longer reach each other; each reaches 0 and 1: keep the lowest of the two largest sets
    cut = {0: {1, 2, 3}, 1: {0, 2, 3}, 2: {0, 1}, 3: {0, 1}}
    assert kept(cut) == [0, 1, 2] and not complete(cut)
    # a reach one way only is no reach (a probe that got through, its answer that could not)
    assert kept({0: {1, 2}, 1: {0, 2}, 2: {0}}) == [0, 1]
    assert complete({0: {1}, 1: {0}}) and kept({0: {1}, 1: {0}}) == [0, 1]
    rng = random.Random(7)
    for _ in range(300):  # against every subset, on random graphs of up to 7 ranks
        n = rng.randint(1, 7)
        reach = {a: {b for b in range(n) if b != a and rng.random() < 0.75} for a in range(n)}
        assert kept(reach) == _exhaustive(reach), reach


def test_the_kept_machines_hold_the_largest_set_of_ranks_that_all_reach_each_other() -> None:
    """Machines of several ranks each, weighed by their ranks: the kept machines' ranks equal an exhaustive search on
    the graph of ranks, in which a machine's ranks reach each other and a rank reaches what its machine reaches."""
    # two machines of one rank each reach everything; machine 2 (four ranks) and machine 6 (one) no longer reach
    # each other: the four are kept, though the machines kept are as many either way
    members = {0: [0], 1: [1], 2: [2, 3, 4, 5], 6: [6]}
    reach = {0: {1, 2, 6}, 1: {0, 2, 6}, 2: {0, 1}, 6: {0, 1}}
    assert kept(reach, members) == [0, 1, 2] and kept(reach) == [0, 1, 2]
    assert kept({0: {1, 2}, 1: {0}, 2: {0}}, {0: [0, 1], 1: [2, 3], 2: [4]}) == [0, 1]  # (ties: the lowest ranks)
    # three machines of one rank that all reach each other, against two that hold five ranks: the five
    reach = {0: {1, 2, 3}, 1: {0, 2}, 2: {0, 1}, 3: {0}}
    assert kept(reach, {0: [0], 1: [1], 2: [2], 3: [3, 4, 5, 6]}) == [0, 3] and kept(reach) == [0, 1, 2]
    rng = random.Random(11)
    for _ in range(300):  # against every subset of ranks, on random machines of up to 3 ranks
        sizes = [rng.randint(1, 3) for _ in range(rng.randint(1, 5))]
        firsts = list(itertools.accumulate([0, *sizes[:-1]]))
        members = {f: list(range(f, f + n)) for f, n in zip(firsts, sizes)}
        reach = {a: {b for b in members if b != a and rng.random() < 0.7} for a in members}
        by_rank = {r: {q for b in reach[m] for q in members[b]} | set(members[m]) - {r}
                   for m in members for r in members[m]}
        assert sorted(r for m in kept(reach, members) for r in members[m]) == _exhaustive(by_rank), (members, reach)


def test_ranks_are_grouped_into_machines_by_the_address_they_reach_the_agent_from() -> None:
    assert machines({3: "10.0.0.2:4001", 0: "10.0.0.1:4000", 1: "10.0.0.1:4002", 2: "10.0.0.2:4003"}) == \
        {0: [0, 1], 2: [2, 3]}
    assert machines({}) == {}


def _refused_address(host: str = "127.0.0.1") -> str:
    """An "ip:port" whose connections are refused now (nothing listens there), as a gone rank's port, or any port
    behind a firewall that rejects, answers."""
    gone = socket.create_server((host, 0))
    address = f"{host}:{gone.getsockname()[1]}"
    gone.close()
    return address


def test_each_rank_probes_its_peers_and_answers_the_agents_round() -> None:
    """Three ranks' probers on one real store, each its own machine; a fourth machine that answers nothing (gone
    silent); a fifth whose first rank is gone (refused) while its second listens; a sixth whose every listener
    refuses (a firewall that rejects what it does not let through): each of the first two answers that it reaches
    the other and the fifth (through its second rank), not the fourth nor the sixth; a rank asked nothing answers
    nothing."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    probers = [Prober(i, "127.0.0.1", port) for i in range(3)]
    with silent_address("127.0.0.3") as silent:
        for p in probers:
            p.tick(store)  # says its address
        assert route_address("127.0.0.1", port) == "127.0.0.1"
        assert store.get(ADDRESS_KEY.format(0)).decode() == probers[0].address
        listeners = [[0, [probers[0].address]], [1, [probers[1].address]], [3, [silent]],
                     [4, [_refused_address(), probers[2].address]], [6, [_refused_address(), _refused_address()]]]
        store.set(ASK_KEY, json.dumps({"round": 1, "ranks": [0, 1, 3, 4, 6], "machines": listeners}))
        keys = [ANSWER_KEY.format(1, i) for i in (0, 1)]  # (rank 2 is not asked this round)
        for _ in range(200):
            for p in probers:
                p.tick(store)
            if store.check(keys):
                break
            time.sleep(0.05)
        assert [json.loads(store.get(k)) for k in keys] == [[1, 4], [0, 4]]
        assert not store.check([ANSWER_KEY.format(1, 2)])
        assert probe({2: [probers[2].address], 3: [silent, probers[0].address], 4: ["127.0.0.1:9"]}, 1.0) == [2]
        # (a timeout ends a machine's probe: its path fails, whatever listens behind it; port 9 refuses)


@pytest.mark.parametrize("address", ["127.0.0.1:notaport", "no-port"])
def test_an_address_that_cannot_be_probed_is_not_reached(address: str) -> None:
    assert probe({5: [address]}, 0.5) == [] and probe({5: []}, 0.5) == []
