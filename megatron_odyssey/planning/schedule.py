"""The operation order every node follows: one source for the estimator and the runtime executor.

Each pipeline runs 1F1B. A node that adopts a dead peer's micro-batches (rerouting) runs the union
of its own operations and the adopted ones, ordered by when each operation would start in the
fault-free schedule (unit costs F=1, B=2). Every node's order is then a sub-sequence of one global
order in which each operation comes after everything it depends on, so executing the orders with
blocking receives and non-blocking sends cannot deadlock, and the estimator can play them exactly.

A *filled* rerouted plan (``ExecutionPlan.fill``, ReCycle's decoupled back-propagation) splits the
backward of every non-first stage into B,
which computes only the input gradient the previous stage waits for, and W, the weight gradient,
which nobody waits for. W is deferred: a node runs a pending W whenever its next operation's input
has not arrived (a bubble), and the rest at the end of the step. Where the W's go is decided once,
by playing the plan with unit costs (F=1, B=1, W=1) in :func:`filled_schedule`, so the runtime and
the estimator execute the same orders, and the start slots of that play are again one global order
that respects every dependency.
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import NamedTuple

from .plan import ExecutionPlan, symmetric_plan

FORWARD, BACKWARD, WEIGHT_GRAD = "F", "B", "W"


class Op(NamedTuple):
    """One operation of a step. A named tuple, not a dataclass: the estimator hashes and compares hundreds of
    thousands of them per decision at hundreds of micro-batches per pipeline, and a tuple does that in C."""
    kind: str  # FORWARD, BACKWARD (with a W later: input gradient only) or WEIGHT_GRAD
    pipeline: int
    stage: int
    micro_batch: int  # index within the pipeline


def one_f_one_b(num_stages: int, stage: int, num_micro_batches: int) -> list[tuple[str, int]]:
    """Megatron's non-interleaved 1F1B order for one stage: warm-up forwards, steady 1F1B, cool-down."""
    m = num_micro_batches
    warmup = min(num_stages - stage - 1, m)
    order = [(FORWARD, j) for j in range(warmup)]
    for j in range(m - warmup):
        order.append((FORWARD, warmup + j))
        order.append((BACKWARD, j))
    order.extend((BACKWARD, j) for j in range(m - warmup, m))
    return order


@lru_cache(maxsize=4096)
def run_ahead_order(num_stages: int, num_micro_batches: int) -> tuple[tuple[str, int, int], ...]:
    """Every (kind, stage, micro-batch) of a 1F1B pipeline in an order where each comes after its stage's previous
    operation and after the operation it consumes: each stage runs ahead as far as its inputs allow, round after
    round. Playing operations in any such order gives the same times, to the bit; this one is O(p x m) list
    steps (the planner meets dozens of micro-batch counts per decision, at hundreds of micro-batches)."""
    p, m = num_stages, num_micro_batches
    orders = [one_f_one_b(p, i, m) for i in range(p)]
    done_f, done_b, pos = [0] * p, [0] * p, [0] * p
    out: list[tuple[str, int, int]] = []
    while len(out) < 2 * p * m:
        progressed = False
        for i, order in enumerate(orders):
            k = pos[i]
            while k < len(order):
                kind, j = order[k]
                if kind == FORWARD:
                    if i and done_f[i - 1] <= j:
                        break
                    done_f[i] += 1
                else:
                    if i < p - 1 and done_b[i + 1] <= j:
                        break
                    done_b[i] += 1
                out.append((kind, i, j))
                k += 1
            progressed |= k > pos[i]
            pos[i] = k
        if not progressed:  # pragma: no cover - 1F1B orders always make progress
            raise RuntimeError("1F1B schedule deadlocked")
    return tuple(out)


@lru_cache(maxsize=4096)
def fault_free_slots(num_stages: int, num_micro_batches: int) -> dict[tuple[str, int, int], int]:
    """Start slot of (kind, stage, micro-batch) in a fault-free 1F1B pipeline with F=1, B=2 time units."""
    p, m = num_stages, num_micro_batches
    end_f = [[0] * m for _ in range(p)]
    end_b = [[0] * m for _ in range(p)]
    start: dict[tuple[str, int, int], int] = {}
    free = [0] * p
    for kind, i, j in run_ahead_order(p, m):
        if kind == FORWARD:
            t0 = max(free[i], end_f[i - 1][j] if i > 0 else 0)
            free[i] = end_f[i][j] = t0 + 1
        else:
            t0 = max(free[i], end_b[i + 1][j] if i < p - 1 else end_f[i][j])
            free[i] = end_b[i][j] = t0 + 2
        start[(kind, i, j)] = t0
    return start


def node_operations(plan: ExecutionPlan) -> dict[int, list[Op]]:
    """node -> the operations it executes this step, in execution order (live nodes only)."""
    if plan.fill:
        return {n: list(ops) for n, ops in filled_schedule(plan)[0].items()}
    return _slot_ordered_operations(plan)


def _slot_ordered_operations(plan: ExecutionPlan, only: frozenset[int] | None = None) -> dict[int, list[Op]]:
    """node -> its operations in fault-free slot order; ``only``: just these pipelines' operations (and
    the nodes that run them: the estimator plays the coupled pipelines alone)."""
    table = plan.executor()
    keyed: dict[int, list[tuple[int, int, Op]]] = {n: [] for n in plan.live_nodes()} if only is None else {}
    for k, pipe in enumerate(plan.pipelines):
        if only is not None and k not in only:
            continue
        slots = fault_free_slots(pipe.length, pipe.micro_batches)
        for i, stage in enumerate(pipe.stages):
            for kind, j in one_f_one_b(pipe.length, i, pipe.micro_batches):
                node = table.get((k, i, j), stage.node)
                # own work before adopted work at equal slots keeps a peer's own pipeline on time
                keyed.setdefault(node, []).append((slots[(kind, i, j)], 0 if node == stage.node else 1, Op(kind, k, i, j)))
    return {n: [op for _, _, op in sorted(ops)] for n, ops in keyed.items()}


def coupled_pipelines(plan: ExecutionPlan) -> frozenset[int]:
    """Pipelines whose timing depends on another pipeline: a dead stage, or a node adopting work."""
    if not plan.reroutes:
        return frozenset()
    pos = plan.position_of()
    out = set()
    for r in plan.reroutes:
        out.add(r.pipeline)
        out.add(pos[r.peer][0])
    return frozenset(out)


def deferred(plan: ExecutionPlan) -> frozenset[tuple[int, int]]:
    """(pipeline, stage) whose backward is split into B and a deferred W in ``plan``: every stage but
    the first (whose input gradient nobody waits for) of every pipeline. Splitting only the pipelines a
    reroute couples would make a further failure that couples more pipelines speed the step up."""
    if not plan.fill:
        return frozenset()
    return frozenset((k, i) for k, p in enumerate(plan.pipelines) for i in range(1, p.length))


def overlapped_nodes(plan: ExecutionPlan) -> frozenset[int]:
    """Nodes whose gradient all-reduces can start inside the step's last backward (``--overlap-grad-reduce``):
    those whose last gradient operation is a whole backward. A node of a filled reroute's deferred stage ends
    on a W (its B left the weight gradients for later), so its reductions wait for the end of the step."""
    split = deferred(plan)
    out = []
    for node, ops in node_operations(plan).items():
        grads = [op for op in ops if op.kind in (BACKWARD, WEIGHT_GRAD)]
        if grads and grads[-1].kind == BACKWARD and (grads[-1].pipeline, grads[-1].stage) not in split:
            out.append(node)
    return frozenset(out)


@lru_cache(maxsize=64)
def filled_schedule(plan: ExecutionPlan) -> tuple[dict[int, tuple[Op, ...]], dict[Op, int]]:
    """Every node's order in a filled plan, and each operation's start slot in the unit-cost play.

    Forward and backward keep the slot order of :func:`node_operations`; a node whose next operation
    is still waiting for its input runs the oldest pending W instead (one slot), so W's fill the
    bubbles that adopted work leaves and never delay a B anyone waits for by more than one slot.
    Pipelines no reroute couples play alone, each like every other of its shape (played once)."""
    seq, start = coupled_orders(plan)
    seq, start = dict(seq), dict(start)
    pos = plan.position_of()
    for n in set(plan.live_nodes()) - seq.keys():
        k, i = pos[n]
        pipe = plan.pipelines[k]
        ops = []
        for slot, kind, j in lone_filled_pipeline(pipe.length, pipe.micro_batches)[i]:
            op = Op(kind, k, i, j)
            start[op] = slot
            ops.append(op)
        seq[n] = tuple(ops)
    return seq, start


@lru_cache(maxsize=64)
def coupled_orders(plan: ExecutionPlan, pipelines: frozenset[int] | None = None
                   ) -> tuple[dict[int, tuple[Op, ...]], dict[Op, int]]:
    """The nodes of the pipelines a reroute couples, their orders and a global start slot per
    operation (fault-free slots, or the filled play's): all the estimator needs to play them, without
    building the orders of every other node (thousands at scale). ``pipelines``: these instead."""
    coupled = coupled_pipelines(plan) if pipelines is None else pipelines
    orders = _slot_ordered_operations(plan, coupled)
    if plan.fill:
        return _play_filled(plan, orders)
    start = {}
    for ops in orders.values():
        for op in ops:
            pipe = plan.pipelines[op.pipeline]
            start[op] = fault_free_slots(pipe.length, pipe.micro_batches)[(op.kind, op.stage, op.micro_batch)]
    return {n: tuple(ops) for n, ops in orders.items()}, start


@lru_cache(maxsize=256)
def lone_filled_plan(num_stages: int, num_micro_batches: int) -> ExecutionPlan:
    """One filled pipeline that shares no node with another: every such pipeline of this shape plays
    like it (the estimator times it, :func:`filled_schedule` copies its orders)."""
    return replace(symmetric_plan(num_stages, 1, num_stages, num_micro_batches), fill=True)


@lru_cache(maxsize=256)
def lone_filled_pipeline(num_stages: int, num_micro_batches: int) -> tuple[tuple[tuple[int, str, int], ...], ...]:
    """Per stage, (slot, kind, micro-batch) of :func:`lone_filled_plan`'s play."""
    plan = lone_filled_plan(num_stages, num_micro_batches)
    seq, start = coupled_orders(plan, frozenset({0}))
    node_stage = {s.node: i for i, s in enumerate(plan.pipelines[0].stages)}
    out: list[tuple[tuple[int, str, int], ...]] = [()] * num_stages
    for n, ops in seq.items():
        out[node_stage[n]] = tuple((start[op], op.kind, op.micro_batch) for op in ops)
    return tuple(out)


def _play_filled(plan: ExecutionPlan, orders: dict[int, list[Op]]) -> tuple[dict[int, tuple[Op, ...]], dict[Op, int]]:
    """The unit-cost play of :func:`filled_schedule` for the nodes in ``orders`` (which must include
    every node their operations depend on)."""
    split = deferred(plan)
    start: dict[Op, int] = {}
    end: dict[Op, int] = {}
    idx = {n: 0 for n in orders}
    free = {n: 0 for n in orders}
    pending: dict[int, list[Op]] = {n: [] for n in orders}
    seq: dict[int, list[Op]] = {n: [] for n in orders}
    cap = {n: plan.pipelines[ops[0].pipeline].length if ops else 1 for n, ops in orders.items()}
    lengths = [pipe.length for pipe in plan.pipelines]
    busy = sorted(orders)
    t = 0
    while busy:
        still = []
        for n in busy:
            ops = orders[n]
            if free[n] <= t:
                op = ops[idx[n]] if idx[n] < len(ops) else None
                if len(pending[n]) >= cap[n]:  # bound the activations held for W
                    op = None
                dep = dependency(op, lengths[op.pipeline]) if op is not None else None
                if op is not None and (dep is None or end.get(dep, t + 1) <= t):
                    if op.kind == BACKWARD and (op.pipeline, op.stage) in split:
                        dur = 1
                        pending[n].append(Op(WEIGHT_GRAD, op.pipeline, op.stage, op.micro_batch))
                    else:
                        dur = 1 if op.kind == FORWARD else 2
                    idx[n] += 1
                elif pending[n]:
                    op, dur = pending[n].pop(0), 1
                else:
                    op = None
                if op is not None:
                    start[op], end[op] = t, t + dur
                    free[n] = t + dur
                    seq[n].append(op)
            if idx[n] < len(ops) or pending[n]:
                still.append(n)
        busy = still
        t += 1
    return {n: tuple(ops) for n, ops in seq.items()}, start


def dependency(op: Op, num_stages: int) -> Op | None:
    """The operation whose output ``op`` consumes (Eq. 11's f1/f2 mapping); a W consumes its own B's."""
    kind, k, i, j = op
    if kind == WEIGHT_GRAD:
        return Op(BACKWARD, k, i, j)
    if kind == FORWARD:
        return Op(FORWARD, k, i - 1, j) if i > 0 else None
    if i < num_stages - 1:
        return Op(BACKWARD, k, i + 1, j)
    return Op(FORWARD, k, i, j)


# -- point-to-point messages ----------------------------------------------------------------------

Message = tuple[str, int, int, int]  # (kind, pipeline, sending stage, micro-batch)


def pair_messages(plan: ExecutionPlan) -> dict[tuple[int, int], list[Message]]:
    """(src node, dst node) -> the messages src sends dst in one step, in src's execution order.

    NCCL and HCCL ignore tags: between two ranks, the n-th receive gets the n-th send. A node that
    serves two pipelines (rerouting) can order two pipelines' messages to the same peer differently
    from that peer (ties at equal fault-free slots are broken by ownership, which differs), so the
    receiver must take a sender's messages in the *sender's* order; this table is that order.
    """
    table = plan.executor()

    def node_of(k: int, i: int, j: int) -> int:
        return table.get((k, i, j), plan.pipelines[k].stages[i].node)

    out: dict[tuple[int, int], list[Message]] = {}
    for node, ops in node_operations(plan).items():
        for op in ops:
            k, i, j = op.pipeline, op.stage, op.micro_batch
            last = plan.pipelines[k].length - 1
            if op.kind == FORWARD and i < last:
                out.setdefault((node, node_of(k, i + 1, j)), []).append((FORWARD, k, i, j))
            elif op.kind == BACKWARD and i > 0:
                out.setdefault((node, node_of(k, i - 1, j)), []).append((BACKWARD, k, i, j))
    return out


def receive_orders(plan: ExecutionPlan, node: int) -> dict[int, list[Message]]:
    """src node -> what ``node`` receives from it, in the order src sends it."""
    return {src: msgs for (src, dst), msgs in pair_messages(plan).items() if dst == node}
