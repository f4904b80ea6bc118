"""Weight-transfer matching against brute force; gradient-sync colouring validity."""
import itertools
import random

import pytest

from megatron_odyssey.planning.plan import layout, symmetric_plan
from megatron_odyssey.planning.profile import builtin_profile, uniform_profile
from megatron_odyssey.planning.restorer import (assign_nodes, check_colouring, match_positions, schedule_transfers,
                                                sync_rounds, transfer_cost_matrix)


def _random_ranges(rng, n, units):
    out = []
    for _ in range(n):
        a = rng.randrange(units)
        b = rng.randrange(a, units)
        out.append(frozenset(range(a, b + 1)))
    return out


@pytest.mark.parametrize("n", range(1, 8))
def test_matching_equals_brute_force(n):
    rng = random.Random(n)
    for _ in range(5):
        units = 10
        sizes = [rng.randint(1, 50) for _ in range(units)]
        old, new = _random_ranges(rng, n, units), _random_ranges(rng, n, units)
        cost = transfer_cost_matrix(old, new, sizes)
        brute = min(sum(cost[perm[j], j] for j in range(n)) for perm in itertools.permutations(range(n)))
        owner, total = match_positions(old, new, sizes)
        assert sorted(owner) == list(range(n))
        assert total == pytest.approx(brute)
        # cost[i][j] really is "bytes node i lacks for position j"
        for i in range(n):
            for j in range(n):
                assert cost[i, j] == sum(sizes[u] for u in new[j] - old[i])


def test_transfer_schedule_spreads_load_over_holders():
    holdings = {0: frozenset({1, 2}), 1: frozenset({1, 2}), 2: frozenset({3})}
    targets = {2: frozenset({1, 2, 3})}
    sched = schedule_transfers(holdings, targets, [0, 5, 5, 5])
    assert sorted((t.unit, t.dst) for t in sched.transfers) == [(1, 2), (2, 2)]
    assert {t.src for t in sched.transfers} == {0, 1}  # one from each holder, not both from node 0
    assert sched.total_bytes == 10
    assert sched.time_s(5.0) == 2.0  # node 2 receives 10 bytes at 5 B/s


def test_assign_nodes_keeps_survivors_where_their_layers_are():
    prof = uniform_profile(8)
    current = symmetric_plan(2, 4, 8, 8)  # stage 0 = nodes 0-3 (layers 0-3), stage 1 = nodes 4-7
    dead = current.__class__(current.policy, 8, current.pipelines, failed=frozenset({7}))
    new_layout = layout([((4, 4), 3), ((4, 4), 3), ((3, 2, 3), 2)])
    plan, sched = assign_nodes(dead, new_layout, prof)
    plan.validate(valid_nodes=dead.live_nodes())
    assert sorted(plan.nodes()) == dead.live_nodes()
    # the two unchanged pipelines need nothing; only the 3-stage one moves layers
    assert all(t.dst in {s.node for s in plan.pipelines[2].stages} for t in sched.transfers)


def test_colouring_is_valid_and_reports_rounds():
    prof = builtin_profile(num_layers=8)
    plan = layout([((2, 2, 2, 2), 4), ((3, 2, 3), 4), ((4, 4), 4)])
    rounds = sync_rounds(plan, prof)
    check_colouring(plan, rounds)
    synced = {u for r in rounds.rounds for u in r}
    assert synced == set(range(10))  # embedding, 8 layers, output: every unit held by >= 2 nodes
    assert rounds.num_rounds >= rounds.lower_bound == 5  # the [4,4] pipeline's first node: embedding + 4 layers
    assert rounds.time_s > 0


def test_symmetric_layout_needs_exactly_the_lower_bound():
    plan = symmetric_plan(4, 3, 16, 12)
    rounds = sync_rounds(plan, builtin_profile(num_layers=16))
    check_colouring(plan, rounds)
    assert rounds.num_rounds == rounds.lower_bound == 5  # 4 layers + embedding/output on the end stages


def test_single_holder_units_need_no_sync():
    plan = symmetric_plan(2, 1, 4, 2)
    rounds = sync_rounds(plan, uniform_profile(4))
    assert rounds.rounds == [] and rounds.time_s == 0


@pytest.mark.parametrize("dead", [{5}, {5, 17}, {0, 40, 63}])
def test_matching_of_a_big_cluster_by_classes_equals_kuhn_munkres(dead):
    """64 nodes hold 4 distinct stages: the matching runs between classes (min-cost flow), and costs what
    the node-level Kuhn-Munkres costs, with every survivor used once."""
    from scipy.optimize import linear_sum_assignment

    prof = uniform_profile(16)
    current = symmetric_plan(4, 16, 16, 16)
    current = current.__class__(current.policy, 16, current.pipelines, failed=frozenset(dead))
    holdings = current.holdings()
    old = [holdings[n] for n in sorted(holdings)]
    sizes = [u.state_bytes for u in prof.units()]
    n = len(old)
    tail = {0: [], 1: [((16,), 1)], 2: [((8, 8), 1)]}
    for spec in ([((4, 4, 4, 4), 1)] * 12 + [((6, 5, 5), 1)] * ((n - 48) // 3) + tail[(n - 48) % 3],
                 [((8, 8), 1)] * (n // 2) + tail[n % 2]):
        new_layout = layout(spec)
        new = [new_layout.stage_units(k, i) for k, p in enumerate(new_layout.pipelines) for i in range(p.length)]
        assert len(new) == n
        cost = transfer_cost_matrix(old, new, sizes)
        rows, cols = linear_sum_assignment(cost)
        owner, total = match_positions(old, new, sizes)
        assert sorted(owner) == list(range(n))
        assert total == pytest.approx(float(cost[rows, cols].sum()))
        assert total == pytest.approx(sum(cost[owner[j], j] for j in range(n)))
