"""Time and memory of a plan: the paper's closed forms (Eq. 9, 12, 13, 14) and the general Eq. 11
simulation that plays every node's actual operation order.

Step time = slowest pipeline (Eq. 10, from the simulation) + gradient-sync rounds x their all-reduce
cost (restorer colouring) + the slowest node's optimizer step. The closed forms are kept for the
settings they describe (uniform stages, no communication) and the tests check that the simulation
reproduces Eq. 9 exactly there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Mapping

from .plan import ExecutionPlan
from .profile import LayerCost, ModelProfile
from .sharding import loss_sets, optimizer_share, tied_holders
from .schedule import (BACKWARD, FORWARD, WEIGHT_GRAD, coupled_orders, coupled_pipelines, deferred, lone_filled_plan,
                       run_ahead_order)

# -- closed forms ---------------------------------------------------------------------------------


def eq9_step_time(n_pp: int, n_m: int, t_f: float, t_b: float) -> float:
    """Symmetric 1F1B: (N_pp + N_m - 1)(T_f + T_b)."""
    return (n_pp + n_m - 1) * (t_f + t_b)


def eq12_step_time(n_pp: int, n_m: int, n_dp: int, t_f: float, t_b: float) -> float:
    """Rerouting after one failure: the dead node's N_m micro-batches spread over N_dp - 1 peers."""
    if n_dp < 2:
        return math.inf
    return (n_pp + n_m - 1 + n_m / (n_dp - 1)) * (t_f + t_b)


def eq13_step_time(n_pp: int, n_m: int, n_dp: int, failures_per_stage: list[int], t_f: float, t_b: float) -> float:
    """Rerouting after several failures; infinite when a stage has lost every replica."""
    if len(failures_per_stage) != n_pp:
        raise ValueError(f"need one failure count per stage ({n_pp}), got {len(failures_per_stage)}")
    extra = 0.0
    for f in failures_per_stage:
        if f >= n_dp:
            return math.inf
        if f > 0:
            extra += n_m * f / (n_dp - f)
    return (n_pp + n_m - 1 + extra) * (t_f + t_b)


def eq14_peak_memory(stage: int, n_pp: int, n_layers: int, m_p: int, m_o: int, m_g: int, m_a: int) -> int:
    """Peak memory of zero-based stage ``stage``: N_l(m_p+m_o+m_g) + (N_pp - stage) N_l m_a."""
    return n_layers * (m_p + m_o + m_g) + (n_pp - stage) * n_layers * m_a


def allreduce_time(nbytes: int, group_size: int, bandwidth_Bps: float, latency_s: float) -> float:
    """Ring all-reduce: 2(n-1) hops, each moving bytes/n."""
    if group_size <= 1 or nbytes == 0:
        return 0.0
    n = group_size
    return 2 * (n - 1) / n * nbytes / bandwidth_Bps + 2 * (n - 1) * latency_s


# -- Eq. 11 simulation ----------------------------------------------------------------------------


@dataclass
class Simulation:
    pipeline_times: list[float]
    peak_in_flight: dict[int, int]  # node -> most micro-batches whose activations it holds at once


def _unit_sum(units: list[LayerCost], attr: str) -> float:
    return sum(getattr(u, attr) for u in units)


def stage_layers(plan: ExecutionPlan, profile: ModelProfile, pipeline: int, stage: int) -> list[LayerCost]:
    all_units = profile.units()
    return [all_units[u] for u in sorted(plan.stage_units(pipeline, stage))]


@lru_cache(maxsize=4096)
def _one_f_one_b_order(p: int, m: int) -> tuple[tuple[tuple[bool, int, int], ...], tuple[int, ...]]:
    """The play's order of a p-stage, m-micro-batch 1F1B pipeline (:func:`schedule.run_ahead_order`, as
    (forward?, stage, micro-batch)), and each stage's peak in-flight count: its warm-up forwards plus one."""
    order = tuple((kind == FORWARD, i, j) for kind, i, j in run_ahead_order(p, m))
    return order, tuple(min(p - i, m) for i in range(p))


@lru_cache(maxsize=65536)
def _plain_pipeline(costs: tuple[tuple[float, float], ...], m: int, p2p: float) -> tuple[float, tuple[int, ...]]:
    """Time and per-stage peak in-flight count of one 1F1B pipeline with its own nodes (memoised by shape).

    Each operation starts when its stage is free and its input has arrived (the previous stage's forward, the
    next stage's backward, or on the last stage its own forward)."""
    p = len(costs)
    order, peak = _one_f_one_b_order(p, m)
    fwd = [c[0] for c in costs]
    bwd = [c[1] for c in costs]
    end_f = [[0.0] * m for _ in range(p)]
    end_b = [[0.0] * m for _ in range(p)]
    free = [0.0] * p
    last = p - 1
    for is_forward, i, j in order:
        if is_forward:
            ready = end_f[i - 1][j] + p2p if i else 0.0
            t = free[i]
            free[i] = end_f[i][j] = (t if t >= ready else ready) + fwd[i]
        else:
            ready = end_b[i + 1][j] + p2p if i < last else end_f[i][j]
            t = free[i]
            free[i] = end_b[i][j] = (t if t >= ready else ready) + bwd[i]
    return max(free), peak


def simulate(plan: ExecutionPlan, profile: ModelProfile, staggered: bool = False,
             slowdown: Mapping[int, float] | None = None) -> Simulation:
    """Play every node's operation order (Eq. 11) and return each pipeline's time (Eq. 10's t_p).

    ``staggered`` models ReCycle's staggered optimizer for a filled plan (see :func:`_simulate_coupled`):
    the simulator's ReCycle baseline asks for it; a plan that staggers (``plan.stagger``, which our runtime
    executes) gets it without asking. ``slowdown``: node ->
    factor by which its compute is slower (a fail-slow node, measured by the agent's diagnosis); the
    operations it runs take that much longer, wherever they come from (its own or adopted work)."""
    slow = {n: f for n, f in (slowdown or {}).items() if f != 1.0}
    staggered = staggered or plan.stagger
    per_units: dict[frozenset[int], tuple[float, float, float]] = {}  # thousands of stages, a few distinct ones

    def cost(k: int, i: int) -> tuple[float, float, float]:
        units = plan.stage_units(k, i)
        if units not in per_units:
            ls = stage_layers(plan, profile, k, i)
            per_units[units] = (_unit_sum(ls, "forward_s"), _unit_sum(ls, "backward_s"), _unit_sum(ls, "deferrable_s"))
        return per_units[units]

    costs = [tuple(cost(k, i) for i in range(pipe.length)) for k, pipe in enumerate(plan.pipelines)]
    coupled = coupled_pipelines(plan)
    if slow:
        for k, pipe in enumerate(plan.pipelines):
            if k not in coupled:  # (coupled pipelines' operations are scaled by the node that runs them)
                costs[k] = tuple(tuple(x * slow.get(s.node, 1.0) for x in c) for c, s in zip(costs[k], pipe.stages))
    times = [0.0] * len(plan.pipelines)
    peak: dict[int, int] = {}
    for k, pipe in enumerate(plan.pipelines):
        if k in coupled:
            continue
        if plan.fill:
            times[k], per_stage = _filled_pipeline(costs[k], pipe.micro_batches, profile.p2p_s, staggered)
        else:
            times[k], per_stage = _plain_pipeline(tuple(c[:2] for c in costs[k]), pipe.micro_batches, profile.p2p_s)
        for i, s in enumerate(pipe.stages):
            peak[s.node] = per_stage[i]
    if coupled:
        _simulate_coupled(plan, profile.p2p_s, costs, coupled, times, peak, staggered, slow)
    return Simulation(times, peak)


@lru_cache(maxsize=4096)
def _filled_pipeline(costs: tuple[tuple[float, float, float], ...], m: int, p2p_s: float,
                     staggered: bool) -> tuple[float, tuple[int, ...]]:
    """Time and per-stage peak in-flight count of one filled pipeline with its own nodes (memoised)."""
    lone = lone_filled_plan(len(costs), m)
    times, peak = [0.0], {}
    _simulate_coupled(lone, p2p_s, [costs], frozenset({0}), times, peak, staggered)
    return times[0], tuple(peak.get(s.node, 0) for s in lone.pipelines[0].stages)


def _simulate_coupled(plan: ExecutionPlan, p2p_s: float, costs: list, coupled: frozenset[int],
                      times: list[float], peak: dict[int, int], staggered: bool = False,
                      slow: Mapping[int, float] | None = None) -> None:
    """Play the coupled pipelines' nodes in a global order that respects every dependency: the
    fault-free slots (plain reroute) or the unit-cost play's slots (filled reroute).

    ``staggered``: each stage updates as soon as its own work is done, so in the steady state the
    W's a node runs after its last B overlap the next step's warm-up, during which that node waits
    for its first input (as long as the node's first operation started this step); the node's
    period is max(end of its last B, end - that wait)."""
    orders, slot_of = coupled_orders(plan, coupled)
    split = deferred(plan)
    lengths = [pipe.length for pipe in plan.pipelines]
    executor_of: dict[tuple, int] = {}
    ops: list[tuple[int, int, int, str, int, int]] = []
    for node, node_ops in orders.items():
        for op in node_ops:
            executor_of[op] = node
            ops.append((slot_of[op], op.pipeline, op.stage, op.kind, op.micro_batch, node))
    ops.sort()  # (an operation is unique by its kind, pipeline, stage and micro-batch: the node never decides)
    # keyed by plain (kind, pipeline, stage, micro-batch) tuples, which equal and hash as the Op named tuples do
    end: dict[tuple, float] = {}
    free: dict[int, float] = {}
    first: dict[int, float] = {}  # when each node's first operation starts (its warm-up wait)
    last_b: dict[int, float] = {}  # when its last non-W operation ends
    in_flight: dict[int, int] = {}
    for _, k, i, kind, j, node in ops:
        if kind == WEIGHT_GRAD:  # (schedule.dependency, inlined: this loop runs per operation of every candidate)
            dep = (BACKWARD, k, i, j)
        elif kind == FORWARD:
            dep = (FORWARD, k, i - 1, j) if i > 0 else None
        else:
            dep = (BACKWARD, k, i + 1, j) if i < lengths[k] - 1 else (FORWARD, k, i, j)
        ready = 0.0
        if dep is not None:
            ready = end[dep] + (p2p_s if executor_of[dep] != node else 0.0)
        f, b, w = costs[k][i]
        split_here = (k, i) in split
        if kind == FORWARD:
            in_flight[node] = in_flight.get(node, 0) + 1
            peak[node] = max(peak.get(node, 0), in_flight[node])
            dur = f
        elif kind == WEIGHT_GRAD:  # a deferred W frees the micro-batch's activations, not its B
            in_flight[node] -= 1
            dur = w
        else:
            in_flight[node] -= 0 if split_here else 1
            dur = b - w if split_here else b
        if slow:
            dur *= slow.get(node, 1.0)
        begin = max(free.get(node, 0.0), ready)
        first.setdefault(node, begin)
        end[(kind, k, i, j)] = free[node] = begin + dur
        if kind != WEIGHT_GRAD:
            last_b[node] = end[(kind, k, i, j)]
    for op, t in end.items():
        k = op[1]
        if k in coupled:
            node = executor_of[op]
            if staggered:
                t = min(t, max(last_b[node], free[node] - first[node]))
            times[k] = max(times[k], t)


# -- full step estimate ---------------------------------------------------------------------------


@dataclass
class StepEstimate:
    pipeline_times: list[float]
    compute_s: float
    sync_s: float
    sync_rounds: int
    sync_lower_bound: int
    optimizer_s: float
    peak_memory_bytes: dict[int, int] = field(default_factory=dict)
    device_memory_bytes: int = 0

    @property
    def step_time_s(self) -> float:
        return self.compute_s + self.sync_s + self.optimizer_s

    @property
    def fits_memory(self) -> bool:
        return all(m <= self.device_memory_bytes for m in self.peak_memory_bytes.values())

    def over_memory(self) -> dict[int, int]:
        return {n: m for n, m in self.peak_memory_bytes.items() if m > self.device_memory_bytes}


def node_memory(plan: ExecutionPlan, profile: ModelProfile, peak_in_flight: dict[int, int]) -> dict[int, int]:
    """Eq. 14 per node, with the in-flight count taken from the node's actual operation order. A staggered
    plan also holds a copy of each unit's state (weights and optimizer state) from its speculative update
    until the step's commit, to roll back to (``runtime.generation``). With a sharded optimizer
    (``profile.optimizer_shard_copies``) a node keeps only its share of each unit's optimizer state, which
    depends on how many nodes hold the unit (``planning.sharding``; with tied embeddings the end units' state
    is counted as sharded over the holders of either end, as the shared weight's is)."""
    units = profile.units()
    copies = profile.optimizer_shard_copies
    holders = plan.holders()
    if profile.tied_embeddings and copies:
        ends = tied_holders(holders, plan.num_layers)
        holders = {**holders, 0: ends, plan.num_layers + 1: ends}
    per_units: dict[frozenset[int], tuple[int, int]] = {}
    out = {}
    for node, held in plan.holdings().items():
        if held not in per_units:
            static = sum(units[u].param_bytes + units[u].grad_bytes
                         + round(units[u].optimizer_bytes * optimizer_share(len(holders[u]), copies))
                         + (units[u].state_bytes if plan.stagger else 0) for u in held)
            per_units[held] = (static, sum(units[u].activation_bytes for u in held))
        static, act = per_units[held]
        out[node] = static + peak_in_flight.get(node, 0) * act
    return out


def estimate_step(plan: ExecutionPlan, profile: ModelProfile, staggered: bool = False,
                  slowdown: Mapping[int, float] | None = None) -> StepEstimate:
    """``slowdown``: node -> compute slowdown factor (see :func:`simulate`); the optimizer waits for the
    slowest stage's update too."""
    from .restorer import sync_rounds  # restorer depends on the estimator's all-reduce model

    sim = simulate(plan, profile, staggered, slowdown)
    rounds = sync_rounds(plan, profile)
    units = profile.units()
    if slowdown:
        optimizer = max((sum(units[u].optimizer_s for u in held) * slowdown.get(node, 1.0)
                         for node, held in plan.holdings().items()), default=0.0)
    else:  # (thousands of nodes hold a few distinct unit sets)
        optimizer = max((sum(units[u].optimizer_s for u in held) for held in set(plan.holdings().values())),
                        default=0.0)
    return StepEstimate(
        pipeline_times=sim.pipeline_times,
        compute_s=max(sim.pipeline_times),
        sync_s=rounds.time_s,
        sync_rounds=rounds.num_rounds,
        sync_lower_bound=rounds.lower_bound,
        optimizer_s=optimizer,
        peak_memory_bytes=node_memory(plan, profile, sim.peak_in_flight),
        device_memory_bytes=profile.device_memory_bytes,
    )


# -- Eq. 8 ----------------------------------------------------------------------------------------


def score(global_batch: int, step_time_s: float, transition_s: float, time_to_next_failure_s: float,
          restart_risk_s: float = 0.0) -> float:
    """Throughput x effective-time ratio (Eq. 8); the time in the new state is the expected time to
    the next failure minus the transition (floored at zero). ``restart_risk_s`` (see
    :func:`restart_risk`) is the expected training time the next failure destroys by forcing a
    checkpoint restart; it counts as time without progress in this state."""
    if not math.isfinite(step_time_s) or step_time_s <= 0:
        return 0.0
    in_state = max(time_to_next_failure_s - transition_s, 0.0)
    total = transition_s + in_state
    ratio = max(in_state - restart_risk_s, 0.0) / total if total > 0 else 1.0
    return global_batch / step_time_s * ratio


#: sizes of failure events and their probabilities: one node at a time (independent failures)
SINGLE_FAILURES: tuple[tuple[int, float], ...] = ((1, 1.0),)


def fatal_probability(plan: ExecutionPlan, bursts: tuple[tuple[int, float], ...] = SINGLE_FAILURES,
                      shard_copies: int = 0, tied: bool = False) -> float:
    """Probability that the next failure event, which takes k live nodes uniformly at random (k drawn
    from ``bursts``; spot reclaims take several at once), removes every live copy of some layer (or, with
    a sharded optimizer, every keeper of some shard of its state: ``planning.sharding.loss_sets``).
    Layers held by the same nodes are one event; the union over different node sets is bounded by
    the sum (exact for one failure at a time: the sets are then disjoint single nodes). ``tied``: the
    embeddings are tied, and the shared weight's shards are kept over the holders of either end."""
    n = len(plan._live_nodes)
    if n == 0:
        return 0.0
    sets = {frozenset(keepers) for nodes in plan._holders.values() for keepers in loss_sets(nodes, shard_copies)}
    if tied and shard_copies:  # (frozensets: the same keepers found twice are one event)
        sets |= {frozenset(k) for k in loss_sets(tied_holders(plan._holders, plan.num_layers), shard_copies)}
    total = 0.0
    for k, p in bursts:
        k = min(k, n)
        fatal = sum(math.comb(n - len(h), k - len(h)) for h in sets if len(h) <= k) / math.comb(n, k)
        total += p * min(fatal, 1.0)
    return total


def fragile(plan: ExecutionPlan, bursts: tuple[tuple[int, float], ...] = SINGLE_FAILURES, shard_copies: int = 0,
            tied: bool = False) -> bool:
    """Whether the next failure event can take every live copy of some layer: the runtime then checkpoints
    right after the plan's first step (``save_on_entry``), so the restart that failure would force loses a
    step or two instead of up to a checkpoint interval (the simulator's Odyssey does the same)."""
    return fatal_probability(plan, bursts, shard_copies, tied) > 0


def restart_risk(plan: ExecutionPlan, restart_cost_s: float,
                 bursts: tuple[tuple[int, float], ...] = SINGLE_FAILURES, shard_copies: int = 0,
                 tied: bool = False) -> float:
    """Expected cost of the restart the next failure event forces in ``plan``: its probability
    (:func:`fatal_probability`) x (relaunch + load + half a checkpoint interval of lost work)."""
    return fatal_probability(plan, bursts, shard_copies, tied) * restart_cost_s
