"""``run_simulation(config)``: build the event streams, run every policy on every seed, collect.

The CLI calls this, then ``result.to_json()`` and ``report.write_outputs(result, out_dir)``.
Memoised planning (CostModel caches, policy decision memos) lives in one ``SimContext`` shared by
all seeds, because the same failure states recur.
"""
from __future__ import annotations

import math
import time
from typing import Callable

from ..planning.errors import PlanningError
from ..planning.models import resolve_profile
from ..planning.profile import ModelProfile
from .config import SimulationConfig
from .errors import SimulationError
from .engine import simulate_policy
from .events import EventStream, add_fail_slow, interval_events, poisson_events, trace_events
from .policies import make_policy
from .policies.base import SimContext
from .profiles import resolve_model
from .result import PolicySummary, SimulationResult
from .traces import Trace, load_trace

NO_FAILURE_MTBF_HOURS = 1e9


def event_stream(config: SimulationConfig, seed: int, trace: Trace | None = None) -> EventStream:
    """The seed's failures (and returns), with its fail-slow episodes laid over them."""
    return add_fail_slow(failure_stream(config, seed, trace), config.fail_slow, config.tp, seed)


def failure_stream(config: SimulationConfig, seed: int, trace: Trace | None = None) -> EventStream:
    if config.process == "trace":
        assert trace is not None
        return trace_events(trace, config.horizon_s, seed)
    if config.process == "interval":
        return interval_events(config.num_nodes, config.failure_interval_h * 3600.0, config.horizon_s, seed)
    return poisson_events(config.num_nodes, config.tp, config.failure_rate or 0.0, config.horizon_s, seed)


def derived_mtbf_hours(config: SimulationConfig, trace: Trace | None) -> float:
    """Per-device MTBF for Eq. 8: given, or 1 / rate, or interval x devices, or from the trace's
    removals per device-hour."""
    if config.mtbf_hours is not None:
        return config.mtbf_hours
    if config.process == "poisson":
        return 1.0 / config.failure_rate if config.failure_rate else NO_FAILURE_MTBF_HOURS
    if config.process == "interval":
        return config.failure_interval_h * config.npus
    assert trace is not None
    stream = trace_events(trace, config.horizon_s)
    alive, t_prev, node_hours, removals = len(stream.initial), 0.0, 0.0, 0
    for e in stream.events:
        node_hours += alive * (e.time_s - t_prev) / 3600.0
        alive += len(e.added) - len(e.removed)
        removals += len(e.removed)
        t_prev = e.time_s
    node_hours += alive * (stream.horizon_s - t_prev) / 3600.0
    if removals == 0 or node_hours <= 0:
        return NO_FAILURE_MTBF_HOURS
    return node_hours * config.tp / removals


def derived_failure_bursts(config: SimulationConfig, trace: Trace | None) -> tuple[tuple[int, float], ...]:
    """How many nodes one failure event takes, for Eq. 8's restart risk: one (Poisson and interval
    processes), or the trace's distribution of removals per event (spot reclaims come in bursts)."""
    if config.process != "trace":
        return ((1, 1.0),)
    assert trace is not None
    sizes = [len(e.removed) for e in trace_events(trace, config.horizon_s).events if e.removed]
    if not sizes:
        return ((1, 1.0),)
    return tuple((k, sizes.count(k) / len(sizes)) for k in sorted(set(sizes)))


def load_profile(config: SimulationConfig) -> ModelProfile:
    """The job's profile: ``profile`` (a JSON file or a built-in name, as ``odyssey plan --profile``
    takes) or the built-in ``model``; a stage needs at least one layer, so PP must not exceed them."""
    if config.profile is None:
        profile = resolve_model(config.model, config.num_layers, config.tp, config.micro_batch, config.seq_length)
        source = f"--model {config.model}"
    else:
        try:
            profile = resolve_profile(config.profile, config.num_layers, config.tp, config.micro_batch)
        except PlanningError as exc:
            raise SimulationError(str(exc)) from None
        source = f"--profile {config.profile}"
    if config.pp > profile.num_layers:
        raise SimulationError(f"--pp {config.pp} is greater than the {profile.num_layers} layers of {source}: "
                              "every pipeline stage needs at least one transformer layer")
    return profile


def run_simulation(config: SimulationConfig, on_progress: Callable[[int, int], None] | None = None,
                   trace: Trace | None = None) -> SimulationResult:
    """Simulate every policy of ``config`` over ``config.seeds`` seeds; ``trace``: ``config.trace``
    already loaded (the CLI reads it first, to name ``--trace`` in its errors)."""
    wall = time.perf_counter()
    if trace is None and config.trace:
        trace = load_trace(config.trace)
    profile = load_profile(config)
    mtbf = derived_mtbf_hours(config, trace)
    ctx = SimContext.build(config, profile, mtbf, derived_failure_bursts(config, trace))
    for name in config.policies:  # a policy that cannot run on this job says so before any seed runs
        make_policy(name, ctx)
    seeds = list(range(config.first_seed, config.first_seed + config.seeds))
    runs: dict[str, list] = {name: [] for name in config.policies}
    bar = None
    if config.progress and on_progress is None:
        from tqdm import tqdm
        bar = tqdm(total=len(seeds), desc="seeds", unit="seed", leave=False)
    for i, seed in enumerate(seeds):
        stream = event_stream(config, seed, trace)
        for name in config.policies:
            runs[name].append(simulate_policy(make_policy(name, ctx), stream, ctx, seed))
        if bar is not None:
            bar.update(1)
        if on_progress is not None:
            on_progress(i + 1, len(seeds))
    if bar is not None:
        bar.close()
    no_failures = EventStream(frozenset(range(config.num_nodes)), (), config.horizon_s)
    fault_free = simulate_policy(make_policy("fault-scaled", ctx), no_failures, ctx).avg_throughput
    result = SimulationResult(config.to_dict(), fault_free, seeds,
                              {n: PolicySummary(n, rs) for n, rs in runs.items()})
    result.info = {
        "profile": profile.name,
        "mtbf_hours_per_device": mtbf if math.isfinite(mtbf) else None,
        "fault_free_step_time_s": ctx.cost.step_time(ctx.initial_plan(list(range(config.num_nodes)))),
        "job_nodes": config.num_nodes,
        "wall_time_s": time.perf_counter() - wall,
    }
    return result
