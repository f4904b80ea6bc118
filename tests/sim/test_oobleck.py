"""Tests for megatron_odyssey.sim.oobleck (Oobleck, SOSP '23, §4-§5)."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from megatron_odyssey.sim.oobleck import (
    OobleckConfig,
    add_nodes,
    build_instantiation,
    distribute_batch,
    enumerate_instantiations,
    enumerate_plans,
    generate_templates,
    instantiate,
    is_recoverable,
    layers_to_copy,
    layers_to_copy_per_node,
    node_layer_ranges,
    reinstantiate,
    representable_node_counts,
    template_node_counts,
)

# ---- closed-form pipeline times used by the tests -------------------------------------------


def t_linear(n: int, m: int) -> float:
    """Perfect scaling: time proportional to work per node."""
    return m / n


def t_1f1b(n: int, m: int) -> float:
    """1F1B with one stage per node: (m + S - 1) slots of (compute/n + p2p)."""
    return (m + n - 1) * (1.0 / n + 0.05)


def t_overhead(n: int, m: int) -> float:
    """Sub-linear speed-up plus a per-node fixed cost."""
    return m / n**0.7 + 0.3 * n


def t_step(n: int, m: int) -> float:
    """Integer-valued, tie-heavy: exercises tie-breaking."""
    return float(math.ceil(m / n))


TIME_FNS = [t_linear, t_1f1b, t_overhead, t_step]


def cfg_of(N: int, f: int, n0: int, B: int = 16, fn=t_1f1b) -> OobleckConfig:
    return OobleckConfig(N, f, n0, B, fn)


# ---- §4.1.1 templates ----------------------------------------------------------------------


def test_templates_match_paper_figure4_example():
    # Figure 4 uses templates of 2, 3 and 4 nodes.  With n0 = 2 that is n_max = N - f*n0 = 4,
    # e.g. N = 8, f = 2 (or N = 6, f = 1).
    assert template_node_counts(cfg_of(8, 2, 2)) == [2, 3, 4]
    assert template_node_counts(cfg_of(6, 1, 2)) == [2, 3, 4]
    assert [t.num_nodes for t in generate_templates(cfg_of(8, 2, 2))] == [2, 3, 4]


@pytest.mark.parametrize("N,f,n0", [(30, 1, 3), (13, 0, 2), (20, 3, 5), (10, 4, 2)])
def test_template_formula(N, f, n0):
    sizes = template_node_counts(cfg_of(N, f, n0))
    assert sizes == list(range(n0, N - f * n0 + 1))
    assert len(sizes) == N - (f + 1) * n0 + 1  # p


def test_config_rejects_too_few_nodes():
    with pytest.raises(ValueError):
        cfg_of(5, 2, 2)  # (f+1)*n0 = 6 > 5


def test_enumeration_matches_paper_figure7_and_13_node_example():
    # Figure 7: all X using 7 nodes with templates (2, 3, 4).
    assert set(enumerate_plans((2, 3, 4), 7)) == {(2, 1, 0), (0, 1, 1)}
    # §4.2.1: 13 nodes = 1*n0 + 1*n1 + 2*n2, but also 0*n0 + 3*n1 + 1*n2, "and more".
    plans13 = set(enumerate_plans((2, 3, 4), 13))
    assert {(1, 1, 2), (0, 3, 1)} <= plans13
    brute = {
        x
        for x in itertools.product(range(7), range(5), range(4))
        if 2 * x[0] + 3 * x[1] + 4 * x[2] == 13
    }
    assert plans13 == brute


def test_enumeration_respects_f_plus_one():
    plans = list(enumerate_plans((2, 3, 4), 7, min_pipelines=3))
    assert plans == [(2, 1, 0)]


# ---- representability (§4.1.1 claim) -------------------------------------------------------


def test_every_count_from_f_plus_1_n0_to_N_is_representable():
    for N in range(1, 41):
        for f in range(0, 4):
            for n0 in range(1, 7):
                if N < (f + 1) * n0:
                    continue
                cfg = cfg_of(N, f, n0, B=64)
                reps = representable_node_counts(cfg)
                assert set(range((f + 1) * n0, N + 1)) <= reps, (N, f, n0)
                assert min(reps) == (f + 1) * n0  # nothing smaller keeps f+1 replicas


def test_representable_matches_enumeration_small():
    for N, f, n0 in [(9, 1, 2), (12, 2, 3), (7, 0, 3)]:
        cfg = cfg_of(N, f, n0, B=64)
        reps = representable_node_counts(cfg, max_nodes=3 * N)
        sizes = template_node_counts(cfg)
        brute = {m for m in range(3 * N + 1) if any(True for _ in enumerate_plans(sizes, m, f + 1))}
        assert reps == brute


def test_counts_above_N_can_have_gaps():
    # Only the 4-node template exists; 9..11 nodes cannot be fully used.
    cfg = cfg_of(8, 1, 4)
    assert representable_node_counts(cfg, 12) == {8, 12}


# ---- §4.2.2 batch distribution -------------------------------------------------------------


def test_batch_distribution_hand_case_beats_equal_split():
    cfg = OobleckConfig(6, 1, 2, 12, t_linear)
    dist = distribute_batch(cfg, [2, 4])
    assert dist.num_microbatches == (4, 8)  # proportional to throughput (1:2)
    assert dist.iteration_time == pytest.approx(2.0)
    equal = max(t_linear(2, 6), t_linear(4, 6))
    assert equal == pytest.approx(3.0)
    assert dist.iteration_time < equal


@pytest.mark.parametrize("fn", TIME_FNS)
def test_batch_distribution_valid_and_optimal(fn):
    rng = random.Random(0)
    for _ in range(40):
        counts = [rng.randint(1, 5) for _ in range(rng.randint(1, 4))]
        B = rng.randint(len(counts), 9)
        cfg = OobleckConfig(sum(counts) + 10, 0, 1, B, fn)
        dist = distribute_batch(cfg, counts)
        assert sum(dist.num_microbatches) == B
        assert all(m >= 1 for m in dist.num_microbatches)
        assert dist.iteration_time == max(fn(n, m) for n, m in zip(counts, dist.num_microbatches))
        best = min(max(fn(n, m) for n, m in zip(counts, ms)) for ms in _compositions(B, len(counts)))
        assert dist.iteration_time == pytest.approx(best)


def test_batch_distribution_needs_a_microbatch_per_pipeline():
    cfg = OobleckConfig(10, 0, 1, 2, t_linear)
    with pytest.raises(ValueError):
        distribute_batch(cfg, [1, 1, 1])


# ---- §4.2 instantiation vs brute force -----------------------------------------------------


def _brute_force_best_time(cfg: OobleckConfig, num_nodes: int) -> float:
    sizes = template_node_counts(cfg)
    B, fn = cfg.global_num_microbatches, cfg.pipeline_time
    best = math.inf
    for k in range(cfg.f + 1, min(B, num_nodes // cfg.n0) + 1):
        for parts in itertools.combinations_with_replacement(sizes, k):
            if sum(parts) != num_nodes:
                continue
            for ms in _compositions(B, k):
                best = min(best, max(fn(n, m) for n, m in zip(parts, ms)))
    return best


def _compositions(total: int, k: int):
    """All k-tuples of positive integers summing to total (stars and bars)."""
    for cuts in itertools.combinations(range(1, total), k - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


@pytest.mark.parametrize("fn", TIME_FNS)
def test_instantiate_matches_brute_force(fn):
    for N, f, n0, B in [(6, 1, 2, 6), (8, 1, 2, 7), (9, 2, 1, 6), (10, 1, 3, 5), (7, 0, 1, 5)]:
        cfg = OobleckConfig(N, f, n0, B, fn)
        for num_nodes in range((f + 1) * n0, N + 1):
            ex = instantiate(cfg, num_nodes, method="exhaustive")
            dp = instantiate(cfg, num_nodes, method="dp")
            assert ex.iteration_time == pytest.approx(_brute_force_best_time(cfg, num_nodes))
            # Both solvers implement the same objective and tie-breaks.
            assert ex.node_counts == dp.node_counts
            assert ex.iteration_time == dp.iteration_time
            assert ex.num_nodes == num_nodes
            assert ex.num_pipelines >= f + 1
            assert sum(ex.microbatches) == B and min(ex.microbatches) >= 1


@pytest.mark.parametrize("fn", TIME_FNS)
def test_dp_matches_exhaustive_on_larger_cases(fn):
    for N, f, n0, B in [(24, 1, 2, 32), (20, 2, 3, 9), (18, 0, 1, 40)]:
        cfg = OobleckConfig(N, f, n0, B, fn)
        for num_nodes in (N, N - 3):
            ex = instantiate(cfg, num_nodes, method="exhaustive")
            dp = instantiate(cfg, num_nodes, method="dp")
            assert (ex.node_counts, ex.microbatches) == (dp.node_counts, dp.microbatches)


def test_instantiate_keeps_f_plus_one_pipelines_even_if_slower():
    # Superlinear speed-up favours one big pipeline, but f=2 demands three.
    fn = lambda n, m: m / n**1.5  # noqa: E731
    cfg = OobleckConfig(10, 2, 1, 12, fn)
    inst = instantiate(cfg, 10)
    assert inst.num_pipelines == 3
    # Not [1, 1, 8]: a 1-node pipeline needs time 1 for its mandatory micro-batch, while
    # [2, 2, 6] finishes in 10/6**1.5 ~ 0.68.
    assert sorted(inst.node_counts) == [2, 2, 6]
    assert inst.iteration_time == pytest.approx(_brute_force_best_time(cfg, 10))


def test_enumerate_instantiations_dicts():
    cfg = cfg_of(6, 1, 2)
    assert sorted(map(sorted, (d.items() for d in enumerate_instantiations(cfg, 6)))) == [
        [(2, 1), (4, 1)],
        [(2, 3)],
        [(3, 2)],
    ]


def test_instantiate_below_minimum_raises():
    with pytest.raises(ValueError):
        instantiate(cfg_of(8, 1, 2), 3)


# ---- §5.1 reinstantiation ------------------------------------------------------------------


def test_reinstantiate_fig8a_simple():
    cfg = cfg_of(9, 1, 2)
    cur = build_instantiation(cfg, [[0, 1, 2, 3], [4, 5, 6], [7, 8]])
    new = reinstantiate(cfg, cur, {0: 1})
    assert [p.nodes for p in new.pipelines] == [(0, 1, 2), (4, 5, 6), (7, 8)]
    assert sum(new.microbatches) == cfg.global_num_microbatches


def test_reinstantiate_fig8b_borrow():
    cfg = cfg_of(9, 1, 2)
    cur = build_instantiation(cfg, [[0, 1, 2, 3], [4, 5, 6], [7, 8]])
    new = reinstantiate(cfg, cur, failed_nodes=[8])
    # The 2-node pipeline borrows from the largest pipeline, which drops to the 3-node template.
    assert [p.nodes for p in new.pipelines] == [(0, 1, 2), (4, 5, 6), (7, 3)]


def test_reinstantiate_fig8c_merge():
    cfg = cfg_of(6, 1, 2)
    cur = build_instantiation(cfg, [[0, 1], [2, 3], [4, 5]])
    new = reinstantiate(cfg, cur, failed_nodes=[5])
    # Nobody can lend (all at n0): merge with the smallest other pipeline.
    assert [p.nodes for p in new.pipelines] == [(0, 1, 4), (2, 3)]


def test_reinstantiate_merges_short_pipelines_together():
    cfg = cfg_of(9, 1, 3)
    cur = build_instantiation(cfg, [[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    new = reinstantiate(cfg, cur, {0: 1, 1: 2})
    assert [p.nodes for p in new.pipelines] == [(0, 1, 3), (6, 7, 8)]


def test_reinstantiate_recreates_pipeline_to_keep_f_plus_one():
    cfg = cfg_of(6, 1, 2)
    cur = build_instantiation(cfg, [[0, 1, 2, 3], [4, 5]])
    new = reinstantiate(cfg, cur, {1: 2})
    assert new.num_pipelines == 2
    assert sorted(new.active_nodes) == [0, 1, 2, 3]


@pytest.mark.parametrize("fn", [t_1f1b, t_overhead])
def test_one_failure_keeps_every_survivor_busy(fn):
    for N, f, n0 in [(12, 1, 2), (16, 2, 2), (15, 1, 3), (10, 0, 1), (20, 3, 3)]:
        cfg = OobleckConfig(N, f, n0, 24, fn)
        cur = instantiate(cfg, N)
        for victim in cur.active_nodes:
            new = reinstantiate(cfg, cur, failed_nodes=[victim])
            if N - 1 < (f + 1) * n0:
                assert new is None
                continue
            survivors = sorted(u for u in cur.active_nodes if u != victim)
            assert sorted(new.active_nodes) == survivors  # every survivor used exactly once
            assert new.idle_nodes == ()
            assert new.num_pipelines >= f + 1
            assert all(n0 <= n <= cfg.max_template_nodes for n in new.node_counts)
            assert sum(new.microbatches) == 24 and min(new.microbatches) >= 1


def test_repeated_failures_until_oobleck_stops():
    rng = random.Random(1)
    cfg = cfg_of(14, 1, 3, B=20)
    cur = instantiate(cfg, 14)
    alive = 14
    while True:
        victim = rng.choice(cur.active_nodes)
        new = reinstantiate(cfg, cur, failed_nodes=[victim])
        alive -= 1
        if alive < 6:
            assert new is None
            break
        assert new is not None and new.num_nodes == alive
        assert all(3 <= n <= cfg.max_template_nodes for n in new.node_counts)
        cur = new


def test_reinstantiate_returns_none_below_threshold():
    cfg = cfg_of(4, 1, 2)
    cur = instantiate(cfg, 4)
    assert reinstantiate(cfg, cur, {0: 1}) is None
    cfg = cfg_of(10, 2, 3)
    cur = instantiate(cfg, 10)
    assert reinstantiate(cfg, cur, failed_nodes=cur.active_nodes[:2]) is None  # 8 < 9


def test_reinstantiate_none_when_a_layer_loses_every_replica():
    cfg = cfg_of(4, 1, 1)
    cur = build_instantiation(cfg, [[0, 1], [2, 3]])
    assert not is_recoverable(cur, [0, 2], num_layers=4)
    assert reinstantiate(cfg, cur, failed_nodes=[0, 2], num_layers=4) is None
    assert reinstantiate(cfg, cur, failed_nodes=[0, 3], num_layers=4) is not None
    assert reinstantiate(cfg, cur, failed_nodes=[0, 2]) is not None  # no layer check requested


# ---- node additions ------------------------------------------------------------------------


def test_add_nodes_back_reinstantiates_at_full_size():
    cfg = cfg_of(10, 1, 2, B=16, fn=t_overhead)
    start = instantiate(cfg, 10)
    after_fail = reinstantiate(cfg, start, failed_nodes=[3])
    back = add_nodes(cfg, after_fail, [3])
    assert sorted(back.active_nodes) == list(range(10))
    assert back.node_counts == instantiate(cfg, 10).node_counts
    assert back.iteration_time == start.iteration_time
    # Count form: fresh ids continue after the largest known id.
    assert sorted(add_nodes(cfg, after_fail, 1).active_nodes) == [0, 1, 2, 4, 5, 6, 7, 8, 9, 10]


def test_add_nodes_beyond_N_leaves_unusable_nodes_idle():
    cfg = cfg_of(8, 1, 4)
    cur = instantiate(cfg, 8)
    grown = add_nodes(cfg, cur, 1)
    assert grown.num_nodes == 8 and len(grown.idle_nodes) == 1
    # An idle node is the first lender after a failure.
    new = reinstantiate(cfg, grown, failed_nodes=[0])
    assert new.num_nodes == 8 and new.idle_nodes == ()


# ---- layer copies --------------------------------------------------------------------------


def test_node_layer_ranges_even_contiguous():
    assert node_layer_ranges(8, 3) == (range(0, 2), range(2, 5), range(5, 8))
    assert sum(len(r) for r in node_layer_ranges(13, 5)) == 13


def test_layers_to_copy_hand_case():
    cfg = cfg_of(9, 1, 2)
    cur = build_instantiation(cfg, [[0, 1, 2, 3], [4, 5, 6], [7, 8]])
    assert layers_to_copy(cur, cur, 8) == 0
    new = reinstantiate(cfg, cur, {0: 1})
    # 4-node pipeline [0,2)[2,4)[4,6)[6,8) -> 3-node [0,2)[2,5)[5,8):
    # node 0 keeps its layers, node 1 needs layer 4, node 2 needs 6 and 7.
    per = layers_to_copy_per_node(cur, new, 8)
    assert per[0] == 0 and per[1] == 1 and per[2] == 2
    assert layers_to_copy(cur, new, 8) == 3


def test_layers_to_copy_new_node_copies_its_whole_slice():
    cfg = cfg_of(9, 1, 2)
    cur = build_instantiation(cfg, [[0, 1, 2, 3], [4, 5, 6], [7, 8]])
    new = build_instantiation(cfg, [[0, 1, 2, 3], [4, 5, 6], [7, 9]])
    assert layers_to_copy_per_node(cur, new, 8) == {u: 0 for u in range(8)} | {9: 4}


def test_random_failure_and_addition_sequences_stay_consistent():
    rng = random.Random(5)
    for _ in range(300):
        n0, f = rng.randint(1, 4), rng.randint(0, 3)
        N = rng.randint((f + 1) * n0, (f + 1) * n0 + 12)
        cfg = OobleckConfig(N, f, n0, rng.randint(N + f + 1, 3 * N + 8), t_1f1b)
        cur = instantiate(cfg, N)
        alive = set(cur.active_nodes)
        for _ in range(rng.randint(1, 6)):
            if rng.random() < 0.25 and len(alive) < N:
                cur = add_nodes(cfg, cur, 1)
                alive = set(cur.all_nodes)
                continue
            victims = rng.sample(list(cur.all_nodes), rng.randint(1, min(3, len(cur.all_nodes))))
            new = reinstantiate(cfg, cur, failed_nodes=victims)
            alive -= set(victims)
            if len(alive) < (f + 1) * n0:
                assert new is None
                break
            assert sorted(new.active_nodes) == sorted(alive) and new.idle_nodes == ()
            assert new.num_pipelines >= f + 1
            assert all(n0 <= n <= cfg.max_template_nodes for n in new.node_counts)
            assert sum(new.microbatches) == cfg.global_num_microbatches
            cur = new


def test_large_clusters_use_the_knapsack_path_quickly():
    # ~10^20 plans at 300 nodes: "auto" must switch to the exact DP, and enumeration must not
    # recurse once per template.
    cfg = cfg_of(300, 1, 2, B=64, fn=t_overhead)
    inst = instantiate(cfg, 300)
    assert inst.num_nodes == 300 and inst.num_pipelines >= 2
    first = next(enumerate_plans(list(range(1, 1200)), 1199, min_pipelines=2))
    assert sum(c * n for c, n in zip(first, range(1, 1200))) == 1199
