"""The replicated-shard layout of the optimizer state after a failure (planning.sharding), by hand and against
brute force, and what the memory model and the restart risk make of it."""
import itertools
import random
from dataclasses import replace

import pytest

from megatron_odyssey.planning.estimator import estimate_step, fatal_probability
from megatron_odyssey.planning.partition import PipelineModel
from megatron_odyssey.planning.plan import symmetric_plan
from megatron_odyssey.planning.planner import Planner, PlannerOptions
from megatron_odyssey.planning.profile import uniform_profile
from megatron_odyssey.planning.sharding import (kept_shards, loss_sets, lost_units, optimizer_share, shard_bounds,
                                                tied_holders)


def test_shard_bounds_hand_computed():
    assert shard_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert shard_bounds(2, 3) == [(0, 1), (1, 2), (2, 2)]  # fewer elements than holders: an empty shard
    assert shard_bounds(5, 1) == [(0, 5)]
    with pytest.raises(ValueError, match="at least one holder"):
        shard_bounds(5, 0)


def test_each_holder_keeps_its_shard_and_the_next():
    assert kept_shards(0, 3, 2) == [0, 1] and kept_shards(2, 3, 2) == [2, 0]
    assert kept_shards(1, 2, 2) == [0, 1]  # two holders: both keep everything
    assert kept_shards(1, 4, 0) == [0, 1, 2, 3]  # not sharded
    assert [optimizer_share(h, 2) for h in (1, 2, 3, 4, 8)] == [1.0, 1.0, 2 / 3, 0.5, 0.25]
    assert optimizer_share(8, 0) == 1.0


def test_loss_sets_hand_computed():
    # shard j is kept by holders j and j-1: nodes (5, 6, 7) -> shard 0 by 5 and 7, shard 1 by 6 and 5, ...
    assert loss_sets((5, 6, 7), 2) == [(5, 7), (6, 5), (7, 6)]
    assert loss_sets((5, 6), 2) == [(5, 6)] and loss_sets((5,), 2) == [(5,)]
    assert loss_sets((5, 6, 7), 0) == [(5, 6, 7)]


def test_lost_units_agree_with_the_keepers_the_runtime_uses():
    """For random holder lists and dead sets: a unit is lost exactly when, with the shards each holder keeps
    (kept_shards, what the runtime keeps), some shard has no live keeper."""
    rng = random.Random(0)
    for _ in range(300):
        copies = rng.choice([0, 1, 2, 3])
        holders = {u: sorted(rng.sample(range(10), rng.randint(1, 6))) for u in range(4)}
        dead = set(rng.sample(range(10), rng.randint(0, 5)))
        brute = []
        for u, nodes in holders.items():
            kept = {s for i, n in enumerate(nodes) if n not in dead for s in kept_shards(i, len(nodes), copies)}
            if kept != set(range(len(nodes))):
                brute.append(u)
        assert lost_units(holders, dead, copies) == brute, (holders, dead, copies)


def test_lost_units_with_tied_embeddings_agree_with_the_keepers_the_runtime_uses():
    """With tied embeddings the shared weight's shards are kept over every holder of either end (in node order,
    as the runtime's tied group): losing some shard of it loses both end units, even where each end unit's own
    keepers survive."""
    rng = random.Random(1)
    L = 3
    for _ in range(300):
        copies = rng.choice([1, 2, 3])
        holders = {u: sorted(rng.sample(range(10), rng.randint(1, 5))) for u in range(L + 2)}
        dead = set(rng.sample(range(10), rng.randint(0, 5)))

        def lost(nodes):
            kept = {s for i, n in enumerate(nodes) if n not in dead for s in kept_shards(i, len(nodes), copies)}
            return kept != set(range(len(nodes)))

        brute = {u for u, nodes in holders.items() if lost(nodes)}
        ends = sorted(set(holders[0]) | set(holders[L + 1]))
        if lost(ends):
            brute |= {0, L + 1}
        assert tied_holders(holders, L) == ends
        assert lost_units(holders, dead, copies, tied_layers=L) == sorted(brute), (holders, dead, copies)
    # two stages on two replicas: nodes 1 and 2 keep every shard of their stages between them with their twins,
    # but both keepers of one shard of the tied weight (ends 0, 1, 2, 3: shard 2 on nodes 1 and 2)
    two = symmetric_plan(2, 2, 4, 4).holders()
    assert lost_units(two, {1, 2}, 2) == [] and lost_units(two, {1, 2}, 2, tied_layers=4) == [0, 5]


def test_tied_embeddings_shard_the_end_units_over_both_ends():
    """Two stages on two replicas: an end unit's state is sharded over its stage's two holders (each keeps it
    all) without tied embeddings, and over the four holders of either end with them (each keeps half). Two
    failures at once then lose some shard in 4 of the 6 pairs instead of 2 (the twins {0, 1} and {2, 3}, and
    the tied weight's neighbours {0, 3} and {1, 2}). Algorithm 1's layer-split filter counts the same bytes."""
    prof = uniform_profile(4, layer_bytes=10, activation_bytes=3)
    ends = replace(prof.layers[0], forward_s=0.0, backward_s=0.0)  # (uniform_profile's ends weigh nothing)
    prof = replace(prof, embedding=replace(ends, name="embedding"), output=replace(ends, name="output"),
                   optimizer_shard_copies=2)
    tied = replace(prof, tied_embeddings=True)
    plan = symmetric_plan(2, 2, 4, 4)
    units = prof.units()
    untied_mem, tied_mem = (estimate_step(plan, p).peak_memory_bytes for p in (prof, tied))
    for node, held in plan.holdings().items():
        assert untied_mem[node] - tied_mem[node] == sum(units[u].optimizer_bytes // 2 for u in held if u in (0, 5)) > 0
    assert fatal_probability(plan, ((2, 1.0),), shard_copies=2) == pytest.approx(2 / 6)
    assert fatal_probability(plan, ((2, 1.0),), shard_copies=2, tied=True) == pytest.approx(4 / 6)
    assert fatal_probability(plan, shard_copies=2, tied=True) == 0.0  # any single failure is survived
    model = PipelineModel(tied).with_pipelines(2)
    assert model.peak_bytes((2, 2), 5) == max(tied_mem.values())
    one_stage = symmetric_plan(1, 2, 4, 2)  # each node holds both ends: the tied weight has two holders
    assert PipelineModel(tied).with_pipelines(2).peak_bytes((4,), 5) == \
        max(estimate_step(one_stage, tied).peak_memory_bytes.values())


def test_node_memory_counts_each_holders_share_of_the_optimizer_state():
    """Eq. 14 with the state sharded two ways over four replicas: every node holds half of its units'
    optimizer bytes (20 per layer of uniform_profile(layer_bytes=10)), weights and gradients in full."""
    prof = uniform_profile(8, layer_bytes=10, activation_bytes=3)
    plan = symmetric_plan(2, 4, 8, 8)
    plain = estimate_step(plan, prof).peak_memory_bytes
    sharded = estimate_step(plan, replace(prof, optimizer_shard_copies=2)).peak_memory_bytes
    units = prof.units()
    for node, held in plan.holdings().items():
        assert plain[node] - sharded[node] == sum(units[u].optimizer_bytes // 2 for u in held)
    # two replicas: each keeps everything, as without sharding
    two = symmetric_plan(2, 2, 8, 8)
    assert estimate_step(two, replace(prof, optimizer_shard_copies=2)).peak_memory_bytes == \
        estimate_step(two, prof).peak_memory_bytes


def test_fatal_probability_counts_the_keepers_of_a_shard():
    """One stage on three replicas: two failures at once never take every copy of a layer, but always both
    keepers of some shard (any two of three are neighbours); on four replicas 4 of the 6 pairs are."""
    three, four = symmetric_plan(1, 3, 4, 3), symmetric_plan(1, 4, 4, 4)
    assert fatal_probability(three, ((2, 1.0),)) == 0.0
    assert fatal_probability(three, ((2, 1.0),), shard_copies=2) == 1.0
    assert fatal_probability(four, ((2, 1.0),), shard_copies=2) == pytest.approx(4 / 6)
    assert fatal_probability(four, shard_copies=2) == 0.0  # one node at a time loses nothing
    pairs = [set(p) for p in itertools.combinations(range(4), 2)]
    assert sum(bool(lost_units(four.holders(), p, 2)) for p in pairs) == 4


def test_layer_split_memory_counts_the_share_of_a_plan_of_that_many_pipelines():
    """Algorithm 1's per-pipeline memory filter (PipelineModel) counts what the final check (Eq. 14,
    node_memory) counts: in a plan of k pipelines every unit has k holders, each keeping its share."""
    prof = replace(uniform_profile(8, layer_bytes=10, activation_bytes=3), optimizer_shard_copies=2)
    model = PipelineModel(prof)
    for k, per_layer in ((1, 40), (2, 40), (3, 20 + 13), (4, 30)):  # 10 + 10 + round(20 x share)
        # two stages of four layers; the first holds min(p - i, m) = 2 micro-batches' activations
        assert model.with_pipelines(k).peak_bytes((4, 4), 5) == 4 * per_layer + 2 * 4 * 3
        plan = symmetric_plan(2, k, 8, 5 * k)
        assert model.with_pipelines(k).peak_bytes((4, 4), 5) == max(estimate_step(plan, prof).peak_memory_bytes.values())
    assert model.with_pipelines(2) is model and model.with_pipelines(4) is model.with_pipelines(4)
    assert PipelineModel(uniform_profile(8, layer_bytes=10)).with_pipelines(4).peak_bytes((4, 4), 5) == 160


@pytest.mark.parametrize("search", ["heuristic", "exhaustive"])
def test_planner_finds_layouts_that_fit_only_with_the_shards(search):
    """Six survivors, 135 bytes a device: three pipelines of two stages (four layers a stage) need 4 x 40 = 160
    bytes with whole optimizer states, 4 x 33 = 132 with a third of each layer's state kept twice over three
    holders, and are faster (204 s against 228 s for two pipelines of three stages). The heuristic finds them,
    and equals the exhaustive search."""
    plain = uniform_profile(8, layer_bytes=10, device_memory_bytes=135)
    sharded = replace(plain, optimizer_shard_copies=2)
    # (no budget: the exhaustive search's estimate of its own length, from its first 0.25 s, is a guess about the
    # machine's load - 99 s on a loaded CI machine for a search that takes 0.4 s on a quiet one)
    options = PlannerOptions(search=search, search_budget_s=None)
    best_plain = Planner(plain, 48, 1, options).search_layout(6, 4, 2)
    planner = Planner(sharded, 48, 1, options)
    best = planner.search_layout(6, 4, 2)
    if search == "exhaustive":  # a front per share of the state: 1 for one or two pipelines, 2/3, 1/2, ...
        st = planner.last_search
        assert st.complete and 0 < st.splits_done <= st.splits_total
    assert [len(p.stages) for p in best_plain.pipelines] == [3, 3]
    assert [len(p.stages) for p in best.pipelines] == [2, 2, 2]
    estimate = estimate_step(best, sharded)
    assert estimate.fits_memory and max(estimate.peak_memory_bytes.values()) == 132
    assert estimate.step_time_s == pytest.approx(204.0) and estimate_step(best_plain, plain).step_time_s == pytest.approx(228.0)
    assert not estimate_step(best, plain).fits_memory
