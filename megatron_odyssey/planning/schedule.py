"""The operation order every node follows: one source for the estimator and the runtime executor.

Each pipeline runs 1F1B. A node that adopts a dead peer's micro-batches (rerouting) runs the union
of its own operations and the adopted ones, ordered by when each operation would start in the
fault-free schedule (unit costs F=1, B=2). Every node's order is then a sub-sequence of one global
order in which each operation comes after everything it depends on, so executing the orders with
blocking receives and non-blocking sends cannot deadlock, and the estimator can play them exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .plan import ExecutionPlan

FORWARD, BACKWARD = "F", "B"


@dataclass(frozen=True, order=True)
class Op:
    kind: str  # FORWARD or BACKWARD
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
def fault_free_slots(num_stages: int, num_micro_batches: int) -> dict[tuple[str, int, int], int]:
    """Start slot of (kind, stage, micro-batch) in a fault-free 1F1B pipeline with F=1, B=2 time units."""
    orders = [one_f_one_b(num_stages, i, num_micro_batches) for i in range(num_stages)]
    end: dict[tuple[str, int, int], int] = {}
    start: dict[tuple[str, int, int], int] = {}
    pos = [0] * num_stages
    free = [0] * num_stages
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for i in range(num_stages):
            while pos[i] < len(orders[i]):
                kind, j = orders[i][pos[i]]
                if kind == FORWARD:
                    dep = (FORWARD, i - 1, j) if i > 0 else None
                else:
                    dep = (BACKWARD, i + 1, j) if i < num_stages - 1 else (FORWARD, i, j)
                if dep is not None and dep not in end:
                    break
                t0 = max(free[i], end[dep] if dep is not None else 0)
                start[(kind, i, j)] = t0
                end[(kind, i, j)] = free[i] = t0 + (1 if kind == FORWARD else 2)
                pos[i] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - 1F1B orders always make progress
            raise RuntimeError("1F1B schedule deadlocked")
    return start


def node_operations(plan: ExecutionPlan) -> dict[int, list[Op]]:
    """node -> the operations it executes this step, in execution order (live nodes only)."""
    table = plan.executor()
    keyed: dict[int, list[tuple[int, int, Op]]] = {n: [] for n in plan.live_nodes()}
    for k, pipe in enumerate(plan.pipelines):
        slots = fault_free_slots(pipe.length, pipe.micro_batches)
        for i, stage in enumerate(pipe.stages):
            for kind, j in one_f_one_b(pipe.length, i, pipe.micro_batches):
                node = table.get((k, i, j), stage.node)
                # own work before adopted work at equal slots keeps a peer's own pipeline on time
                keyed[node].append((slots[(kind, i, j)], 0 if node == stage.node else 1, Op(kind, k, i, j)))
    return {n: [op for _, _, op in sorted(ops)] for n, ops in keyed.items()}


def dependency(op: Op, num_stages: int) -> Op | None:
    """The operation whose output ``op`` consumes (Eq. 11's f1/f2 mapping)."""
    if op.kind == FORWARD:
        return Op(FORWARD, op.pipeline, op.stage - 1, op.micro_batch) if op.stage > 0 else None
    if op.stage < num_stages - 1:
        return Op(BACKWARD, op.pipeline, op.stage + 1, op.micro_batch)
    return Op(FORWARD, op.pipeline, op.stage, op.micro_batch)


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
