"""The per-layer profiler on real megatron-core stage models (1-process gloo world, CPU)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from _runtime_workers import make_batch, run_split
from megatron_odyssey.planning.estimator import estimate_step
from megatron_odyssey.planning.plan import symmetric_plan
from megatron_odyssey.planning.profile import ModelProfile
from megatron_odyssey.runtime import model as M
from megatron_odyssey.runtime.accelerator import seed_all
from megatron_odyssey.runtime.profiler import LayerProfiler, StageProfile, merge_profiles, unit_name

CFG = M.ModelConfig()  # 4 layers, hidden 64, 4 heads, ffn 128, seq 32, vocab 320
L = CFG.num_layers
HARDWARE = dict(allreduce_bandwidth_Bps=1e9, allreduce_latency_s=1e-4, transfer_bandwidth_Bps=1e9,
                device_memory_bytes=8 * 2**30)


def batches(n: int) -> list[dict]:
    return [make_batch(CFG.vocab_size, CFG.seq_length, seed=7 + i) for i in range(n)]


def unit_param_counts() -> dict[int, int]:
    """Parameters per unit from the model's full shapes (TP=1: shards are full tensors)."""
    counts = {u: 0 for u in range(L + 2)}
    for name, shape in M.full_parameter_shapes(CFG).items():
        n = 1
        for d in shape:
            n *= d
        idx = M.global_layer_index(name)
        u = 0 if name.startswith("embedding.") else (L + 1 if idx is None else idx + 1)
        counts[u] += n
    return counts


def profile_stages(ranges: list[tuple[int, int]], n: int = 4, **kw) -> list[LayerProfiler]:
    seed_all(CFG.seed)
    stages = [M.build_stage_model(CFG, a, b) for a, b in ranges]
    profs = [LayerProfiler(s, micro_batch=2, **kw).attach() for s in stages]
    for b in batches(n):
        run_split(stages, b)
    return profs


def test_every_unit_timed_and_sized(gloo_world: None) -> None:
    profs = profile_stages([(0, 2), (2, L)], n=4)
    counts = unit_param_counts()
    seen = set()
    for prof in profs:
        stage = prof.stage_profile()
        assert stage.samples == 3  # 4 micro-batches, the first is warm-up
        for u, cost in stage.units.items():
            seen.add(u)
            assert cost.name == unit_name(u, L)
            assert cost.forward_s > 0 and cost.backward_s > 0, cost
            assert cost.param_bytes == cost.grad_bytes == 4 * counts[u], (u, cost.param_bytes, counts[u])
            assert cost.optimizer_bytes == 2 * cost.param_bytes  # Adam moments, no optimizer given
            assert cost.activation_bytes > 0
        prof.detach()
    assert seen == set(range(L + 2))
    assert sorted(profs[0].units) == [0, 1, 2] and sorted(profs[1].units) == [3, 4, L + 1]


def test_activation_bytes_scale_with_micro_batch(gloo_world: None) -> None:
    """Saved activations grow with the micro-batch; layer ones are the same for every layer."""
    seed_all(CFG.seed)
    stage = M.build_stage_model(CFG, 0, L)
    sizes = {}
    for b in (1, 2):
        prof = LayerProfiler(stage, warmup=0).attach()
        run_split([stage], make_batch(CFG.vocab_size, CFG.seq_length, batch_size=b))
        sizes[b] = {u: c.activation_bytes for u, c in prof.stage_profile().units.items()}
        prof.detach()
    layers = [sizes[2][u] for u in range(1, L + 1)]
    assert len(set(layers)) == 1
    for u in sizes[1]:
        assert sizes[2][u] > sizes[1][u]
    # at least the layer input and the MLP's 2*ffn-wide activation are kept per token
    assert layers[0] >= 4 * 2 * CFG.seq_length * (CFG.hidden_size + 2 * CFG.ffn_hidden_size)


def test_real_optimizer_state_bytes(gloo_world: None) -> None:
    seed_all(CFG.seed)
    stage = M.build_stage_model(CFG, 0, L)
    opt = torch.optim.Adam(stage.parameters(), lr=1e-3)
    prof = LayerProfiler(stage, optimizer=opt).attach()
    for b in batches(2):
        opt.zero_grad()
        run_split([stage], b)
        t0 = time.perf_counter()
        opt.step()
        prof.observe_optimizer_step(time.perf_counter() - t0)
    units = prof.stage_profile().units
    prof.detach()
    for cost in units.values():
        assert cost.optimizer_bytes == 2 * cost.param_bytes  # exp_avg + exp_avg_sq, measured
        assert cost.optimizer_s > 0
    total = sum(c.optimizer_s for c in units.values())
    assert units[0].optimizer_s / total == pytest.approx(units[0].param_bytes / sum(c.param_bytes for c in units.values()))


FWD_DELAY, BWD_DELAY = 0.2, 0.3


def test_time_lands_in_the_right_unit(gloo_world: None) -> None:
    """A delay injected into layer 1's MLP (forward) and its backward shows up in unit 2 only.

    The delays are large next to what a loaded 2-core machine adds to a tiny layer (medians of 6
    passes), so the check stays about attribution, not about timing noise."""

    class Slow(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[override]
            time.sleep(FWD_DELAY)
            return x.clone()

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            time.sleep(BWD_DELAY)
            return g

    seed_all(CFG.seed)
    stage = M.build_stage_model(CFG, 0, L)
    fc2 = stage.decoder.layers[1].mlp.linear_fc2
    fc2.register_forward_hook(lambda m, a, out: (Slow.apply(out[0]), out[1]))
    prof = LayerProfiler(stage).attach()
    for b in batches(6):
        run_split([stage], b)
    units = prof.stage_profile().units
    prof.detach()
    assert units[2].forward_s >= FWD_DELAY and units[2].backward_s >= BWD_DELAY
    for u, c in units.items():  # the delay is attributed to unit 2 alone (margins for a busy machine)
        if u != 2:
            assert c.forward_s < units[2].forward_s - FWD_DELAY / 2, (u, c)
            assert c.backward_s < units[2].backward_s - BWD_DELAY / 2, (u, c)


def test_merge_round_trip_and_estimate(gloo_world: None) -> None:
    profs = profile_stages([(0, 1), (1, 3), (3, L)], n=3)
    parts = [p.stage_profile() for p in profs]
    for p in profs:
        p.detach()
    # ranks ship their parts as JSON (all_gather_object / files)
    shipped = [json.loads(json.dumps(p.to_dict())) for p in parts]
    assert StageProfile.from_dict(shipped[1]) == parts[1]
    profile = merge_profiles(shipped, p2p_s=1e-4, name="tiny", **HARDWARE)
    assert profile.num_layers == L and profile.p2p_s == 1e-4 and profile.micro_batch == 2
    assert profile.seq_length == CFG.seq_length
    assert [u.name for u in profile.units()] == ["embedding", *[f"layer{k}" for k in range(L)], "output"]
    assert profile.embedding == parts[0].units[0] and profile.output == parts[2].units[L + 1]
    assert profile.layers[2] == parts[1].units[3] and profile.layers[3] == parts[2].units[4]
    again = ModelProfile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert again == profile
    est = estimate_step(symmetric_plan(2, 1, L, 4), profile)
    assert est.step_time_s > 0 and est.fits_memory


def test_merge_takes_medians_and_fills_from_base(gloo_world: None) -> None:
    a = profile_stages([(0, L)], n=2)[0]
    b = profile_stages([(0, L)], n=2)[0]
    c, c_rest = profile_stages([(0, 2), (2, L)], n=2)
    c_rest.detach()
    parts = [x.stage_profile() for x in (a, b, c)]
    for x in (a, b, c):
        x.detach()
    merged = merge_profiles(parts, p2p_s=0.0, **HARDWARE)
    f = sorted(p.units[1].forward_s for p in parts)
    assert merged.layers[0].forward_s == pytest.approx(f[1])
    assert merged.layers[3].forward_s == pytest.approx((parts[0].units[4].forward_s + parts[1].units[4].forward_s) / 2)
    with pytest.raises(ValueError, match="layer2"):
        merge_profiles([parts[2]], p2p_s=0.0, **HARDWARE)
    with pytest.raises(ValueError, match="allreduce"):
        merge_profiles(parts, p2p_s=0.0)
    filled = merge_profiles([parts[2]], p2p_s=0.0, base=merged, name="partial")
    assert filled.layers[2] == merged.layers[2] and filled.layers[0] == parts[2].units[1]
    assert filled.device_memory_bytes == HARDWARE["device_memory_bytes"]


@pytest.mark.parametrize("ranges", [[(0, L)], [(0, 2), (2, L)]])
def test_hooks_change_nothing(gloo_world: None, ranges: list[tuple[int, int]]) -> None:
    """Same losses and bit-identical gradients (incl. stage-boundary gradients) with the profiler."""
    results = []
    for profiled in (False, True):
        seed_all(CFG.seed)
        stages = [M.build_stage_model(CFG, a, b) for a, b in ranges]
        profs = [LayerProfiler(s, warmup=0, activation_passes=2).attach() for s in stages] if profiled else []
        losses = [run_split(stages, b) for b in batches(3)]
        grads = {}
        for s in stages:
            grads.update(s.global_grads())
        results.append((losses, grads))
        if profiled:
            assert all(p.stage_profile().samples == 3 for p in profs)
            for p in profs:
                p.detach()
    (l0, g0), (l1, g1) = results
    for a, b in zip(l0, l1):
        assert torch.equal(a, b)
    assert set(g0) == set(g1)
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name


def test_detach_removes_every_hook(gloo_world: None) -> None:
    seed_all(CFG.seed)
    stage = M.build_stage_model(CFG, 0, L)
    prof = LayerProfiler(stage).attach()
    run_split([stage], batches(1)[0])
    prof.detach()
    before = prof._count
    run_split([stage], batches(1)[0])
    assert prof._count == before
    assert not stage._forward_hooks and not stage._forward_pre_hooks
    assert all(not l._forward_hooks and not l._forward_pre_hooks for l in stage.decoder.layers)
    assert all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in stage.parameters())


def test_collective_helpers_in_a_one_rank_world(gloo_world: None) -> None:
    from megatron_odyssey.runtime.profiler import gather_stage_profiles, measure_p2p_s, pipeline_p2p_s

    prof = profile_stages([(0, L)], n=2)[0]
    stage = prof.stage_profile()
    prof.detach()
    assert gather_stage_profiles(stage) == [stage]
    assert measure_p2p_s(0, (CFG.seq_length, 2, CFG.hidden_size)) == 0.0
    assert pipeline_p2p_s(symmetric_plan(1, 1, L, 2), lambda n: 0, (4, 1, 8)) == 0.0


def test_synchronize_runs_before_each_clock_reading(gloo_world: None) -> None:
    calls = []
    seed_all(CFG.seed)
    stage = M.build_stage_model(CFG, 0, L)
    prof = LayerProfiler(stage, synchronize=lambda: calls.append(1)).attach()
    run_split([stage], batches(1)[0])
    prof.detach()
    # forward start/end per unit, backward start/input/parameter readings
    assert len(calls) >= 2 * (L + 2) + 2 * (L + 2)


def test_training_writes_a_measured_profile_the_planner_reads(tmp_path):
    """`odyssey train --profile-out` measures during real training and the result plans."""
    from megatron_odyssey.planning.plan import symmetric_plan
    from megatron_odyssey.planning.planner import Planner
    from megatron_odyssey.planning.profile import ModelProfile
    from megatron_odyssey.runtime.config import TrainConfig
    from megatron_odyssey.standalone.launcher import launch

    out = tmp_path / "profile.json"
    cfg = TrainConfig(nproc=4, tp=1, pp=2, layers=4, hidden=32, heads=4, seq=16, global_batch=8, steps=3,
                      profile_out=str(out))
    launch(cfg, tmp_path / "run", quiet=True)
    profile = ModelProfile.load(out)
    assert profile.num_layers == 4
    assert all(layer.forward_s > 0 and layer.backward_s > 0 for layer in profile.layers)
    assert profile.embedding.param_bytes == 4 * 320 * 32  # vocab x hidden fp32
    decision = Planner(profile, 8, 1).decide(symmetric_plan(2, 2, 4, 8), {1})
    assert decision.plan is not None
