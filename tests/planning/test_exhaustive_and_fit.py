"""The exhaustive search's size and limits, the memory-fit suggestion, and the shared model registry."""
from __future__ import annotations

import time

import pytest

from megatron_odyssey.planning.errors import PlanningError
from megatron_odyssey.planning.estimator import estimate_step
from megatron_odyssey.planning.exhaustive import SearchTooLarge, batch_splits, count_layer_splits, count_layouts
from megatron_odyssey.planning.fit import Grid, fits, suggest_layout
from megatron_odyssey.planning.models import BUILTIN_MODELS, build_builtin, resolve_profile
from megatron_odyssey.planning.partition import length_multisets
from megatron_odyssey.planning.planner import Planner, PlannerOptions
from megatron_odyssey.planning.profile import builtin_profile


def _enumerate(n: int, m: int, layers: int, floor: int) -> int:
    return sum(1 for dp in range(floor, min(n, m) + 1) for lengths in length_multisets(n, dp, 1, layers)
               for _ in batch_splits(lengths, m))


@pytest.mark.parametrize("n,m,layers,floor", [(7, 16, 8, 2), (7, 16, 8, 1), (11, 24, 12, 2), (5, 10, 3, 2),
                                              (15, 12, 8, 2), (6, 6, 6, 1)])
def test_layout_count_equals_what_the_search_enumerates(n, m, layers, floor):
    assert count_layouts(n, m, layers, floor) == (_enumerate(n, m, layers, floor), True)


def test_layout_count_of_a_huge_job_is_a_quick_lower_bound():
    start = time.perf_counter()
    total, exact = count_layouts(127, 512, 80, 2)
    assert time.perf_counter() - start < 2
    assert not exact and total > 1e12
    assert count_layer_splits(127, 512, 80, 2) > 1e20


def test_search_too_large_is_refused_quickly_and_a_time_limit_keeps_the_best_so_far():
    prof = builtin_profile(num_layers=32)
    planner = Planner(prof, 64, 1, PlannerOptions(search="exhaustive"))
    start = time.perf_counter()
    with pytest.raises(SearchTooLarge) as exc:
        planner.search_layout(31, 8, 4)
    assert time.perf_counter() - start < 5
    assert exc.value.status.estimated_s > 60 and exc.value.status.layouts_total > 1e9
    heuristic = Planner(prof, 64, 1).search_layout(31, 8, 4)
    bounded = Planner(prof, 64, 1, PlannerOptions(search="exhaustive", time_limit_s=0.5))
    start = time.perf_counter()
    best = bounded.search_layout(31, 8, 4)
    assert time.perf_counter() - start < 0.5 + 2
    st = bounded.last_search
    assert st.cut_short and not st.complete
    assert estimate_step(best, prof).step_time_s <= estimate_step(heuristic, prof).step_time_s  # never worse


def test_time_limit_must_be_positive():
    with pytest.raises(PlanningError, match="--time-limit"):
        PlannerOptions(search="exhaustive", time_limit_s=0)


@pytest.mark.parametrize("price_risk, layouts", [(True, 1229), (False, 1228)])
def test_small_exhaustive_search_completes_with_its_counted_size(price_risk, layouts):
    """Every layout of 7 nodes; under the two-pipeline floor the single pipeline is not one of them."""
    prof = builtin_profile(num_layers=8, seq_length=4096)
    planner = Planner(prof, 16, 1, PlannerOptions(search="exhaustive", price_restart_risk=price_risk))
    planner.search_layout(7, 4, 2)
    st = planner.last_search
    assert st.complete and not st.cut_short and st.layouts_done == st.layouts_total == layouts


def test_suggested_layout_fits_where_the_given_one_does_not():
    def profile_for_tp(tp: int):
        return build_builtin("llama2-7b", None, tp, 1)

    assert not fits(profile_for_tp(1), 2, 4, 64)
    g = suggest_layout(profile_for_tp, 8, 64, 4)
    assert g == Grid(1, 4, 2) and fits(profile_for_tp(g.tp), g.pp, g.dp, 64)
    big = suggest_layout(lambda tp: build_builtin("llama2-70b", None, tp, 1), 2, 64, 2)
    assert big is not None and big.devices > 2 and fits(build_builtin("llama2-70b", None, big.tp, 1), big.pp, big.dp, 64)


def test_one_registry_of_builtin_models():
    from megatron_odyssey.sim.profiles import MODEL_NAMES

    assert set(MODEL_NAMES) == set(BUILTIN_MODELS) >= {"llama2-7b", "llama2-70b", "gpt3-medium-a100"}
    for name in BUILTIN_MODELS:
        assert resolve_profile(name, 4, 1, 1).num_layers == 4
    with pytest.raises(PlanningError, match="built-in: llama2-7b, llama2-70b, gpt3-medium-a100"):
        resolve_profile("llama2-13b", 4, 1, 1)
