"""Restorer algorithms (Odyssey IV-B): which survivor takes which new position and where its missing
layers come from (min-cost bipartite matching), and in how many rounds the per-layer gradient
all-reduces of an asymmetric layout can run (graph colouring).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import networkx as nx
import numpy as np
from scipy.optimize import linear_sum_assignment

from .errors import PlanningError
from .estimator import allreduce_time
from .plan import ExecutionPlan, Pipeline, Stage
from .profile import ModelProfile

# -- gradient-sync rounds -------------------------------------------------------------------------

COLOURING_STRATEGIES = ("largest_first", "saturation_largest_first", "smallest_last")


@dataclass
class SyncRounds:
    rounds: list[list[int]]  # units all-reduced together in each round
    groups: dict[int, list[int]]  # unit -> live nodes holding it (its all-reduce group)
    lower_bound: int  # most synchronised units held by one node: no schedule needs fewer rounds
    time_s: float

    @property
    def num_rounds(self) -> int:
        return len(self.rounds)


def colour_units(plan: ExecutionPlan) -> tuple[list[list[int]], dict[int, list[int]], int]:
    """Colour the unit-conflict graph (units sharing a node conflict); one colour = one round of
    parallel all-reduces over disjoint node sets. Units held by a single node need no sync.

    Returns (rounds, unit -> holder nodes, lower bound on rounds)."""
    holders = plan.holders()
    groups = {u: nodes for u, nodes in holders.items() if len(nodes) >= 2}
    graph = nx.Graph()
    graph.add_nodes_from(groups)
    held_sets = {frozenset(u for u in units if u in groups) for units in plan.holdings().values()}
    for units in held_sets:
        ordered = sorted(units)
        graph.add_edges_from((a, b) for i, a in enumerate(ordered) for b in ordered[i + 1:])
    lower = max((len(s) for s in held_sets), default=0)
    best: dict[int, int] | None = None
    for strategy in COLOURING_STRATEGIES:
        colours = nx.greedy_color(graph, strategy=strategy)
        if best is None or max(colours.values(), default=-1) < max(best.values(), default=-1):
            best = colours
        if best and max(best.values()) + 1 == lower:
            break
    rounds: dict[int, list[int]] = {}
    for unit, colour in sorted((best or {}).items()):
        rounds.setdefault(colour, []).append(unit)
    return [rounds[c] for c in sorted(rounds)], groups, lower


def sync_rounds(plan: ExecutionPlan, profile: ModelProfile) -> SyncRounds:
    """The colouring's rounds and their time: each round costs its slowest all-reduce."""
    ordered_rounds, groups, lower = colour_units(plan)
    units = profile.units()
    time_s = sum(
        max(allreduce_time(units[u].grad_bytes, len(groups[u]), profile.allreduce_bandwidth_Bps,
                           profile.allreduce_latency_s) for u in r)
        for r in ordered_rounds)
    return SyncRounds(ordered_rounds, groups, lower, time_s)


def check_colouring(plan: ExecutionPlan, rounds: SyncRounds) -> None:
    """Raise if two units of one round share a node (their all-reduces would serialise or deadlock)."""
    for r in rounds.rounds:
        seen: dict[int, int] = {}
        for u in r:
            for node in rounds.groups[u]:
                if node in seen:
                    raise AssertionError(f"units {seen[node]} and {u} share node {node} in one round")
                seen[node] = u


# -- weight transfer ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Transfer:
    unit: int
    src: int
    dst: int
    nbytes: int


@dataclass
class TransferSchedule:
    transfers: list[Transfer] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.transfers)

    def time_s(self, bandwidth_Bps: float) -> float:
        """Transfers run in parallel; each node's link carries what it sends or receives."""
        load: dict[tuple[str, int], int] = {}
        for t in self.transfers:
            load[("send", t.src)] = load.get(("send", t.src), 0) + t.nbytes
            load[("recv", t.dst)] = load.get(("recv", t.dst), 0) + t.nbytes
        return max(load.values(), default=0) / bandwidth_Bps


def _classes(sets: list[frozenset[int]]) -> tuple[list[frozenset[int]], list[int]]:
    """Distinct sets in first-seen order, and each input's class index."""
    index: dict[frozenset[int], int] = {}
    of = [index.setdefault(u, len(index)) for u in sets]
    return list(index), of


def _class_costs(old: list[frozenset[int]], new: list[frozenset[int]], unit_bytes: list[int]) -> np.ndarray:
    return np.array([[sum(unit_bytes[u] for u in need - have) for need in new] for have in old], dtype=float)


def transfer_cost_matrix(old: list[frozenset[int]], new: list[frozenset[int]], unit_bytes: list[int]) -> np.ndarray:
    """cost[i][j] = bytes node i must fetch to take new position j (what it lacks; extras are dropped)."""
    old_classes, old_idx = _classes(old)
    new_classes, new_idx = _classes(new)
    return _class_costs(old_classes, new_classes, unit_bytes)[np.ix_(np.asarray(old_idx), np.asarray(new_idx))]


def match_positions(old: list[frozenset[int]], new: list[frozenset[int]], unit_bytes: list[int]) -> tuple[list[int], float]:
    """Min-cost matching of survivors to new positions; returns (survivor index per position, cost).

    The cost of a pair depends only on the survivor's holding and the position's units, and a big cluster
    has thousands of nodes but a handful of distinct holdings and positions. So the matching is solved
    between those classes (a transportation problem: networkx's min-cost flow, exact on integer bytes) and
    expanded to nodes in index order; Kuhn-Munkres on the node-level matrix (``linear_sum_assignment``) is
    O(n^3) and took 0.1 s per candidate at 4096 nodes. Both give the minimum; a test holds this one to
    brute force on small cases."""
    if len(old) != len(new):
        raise PlanningError(f"{len(old)} survivors cannot fill {len(new)} positions")
    old_classes, old_idx = _classes(old)
    new_classes, new_idx = _classes(new)
    small = _class_costs(old_classes, new_classes, unit_bytes)
    if len(old_classes) * len(new_classes) >= len(old) * len(new) // 4:  # few repeats: the matrix is small
        rows, cols = linear_sum_assignment(small[np.ix_(np.asarray(old_idx), np.asarray(new_idx))])
        owner = [0] * len(new)
        for r, c in zip(rows, cols):
            owner[c] = int(r)
        return owner, float(sum(small[old_idx[r], new_idx[c]] for r, c in zip(rows, cols)))
    graph = nx.DiGraph()
    for a in range(len(old_classes)):
        graph.add_node(("old", a), demand=-old_idx.count(a))
        for b in range(len(new_classes)):
            graph.add_edge(("old", a), ("new", b), weight=int(round(small[a, b])))
    for b in range(len(new_classes)):
        graph.add_node(("new", b), demand=new_idx.count(b))
    flow = nx.min_cost_flow(graph)
    members: dict[int, list[int]] = {}
    for i, a in enumerate(old_idx):
        members.setdefault(a, []).append(i)
    slots: dict[int, list[int]] = {}
    for j, b in enumerate(new_idx):
        slots.setdefault(b, []).append(j)
    free_member = {a: iter(m) for a, m in members.items()}
    free_slot = {b: iter(js) for b, js in slots.items()}
    owner = [0] * len(new)
    total = 0.0
    for a in range(len(old_classes)):
        for b in range(len(new_classes)):
            f = flow[("old", a)].get(("new", b), 0)
            for _ in range(f):
                owner[next(free_slot[b])] = next(free_member[a])
            total += f * small[a, b]
    return owner, total


def schedule_transfers(holdings: dict[int, frozenset[int]], targets: dict[int, frozenset[int]],
                       unit_bytes: list[int]) -> TransferSchedule:
    """For every unit a node needs and lacks, pick a live holder, spreading send load over holders: the
    holder that has sent least so far (lowest node id on a tie).

    Each unit's holders sit in a heap keyed by what they had sent when pushed; a holder chosen for another
    unit since then is pushed again with its new load when it surfaces (loads only grow, so the top whose
    key is current is the least loaded). A scan of every holder per transfer took seconds at 4096 nodes."""
    holders: dict[int, list[tuple[int, int]]] = {}
    for node in sorted(holdings):
        for u in holdings[node]:
            holders.setdefault(u, []).append((0, node))
    sent: dict[int, int] = {n: 0 for n in holdings}
    out = TransferSchedule()
    wanted = sorted(((u, dst) for dst, units in targets.items() for u in units - holdings.get(dst, frozenset())),
                    key=lambda x: (-unit_bytes[x[0]], x[0], x[1]))
    for u, dst in wanted:
        heap = holders.get(u)
        if not heap:
            raise PlanningError(f"unit {u} has no live copy: cannot be transferred to node {dst}")
        while heap[0][0] != sent[heap[0][1]]:
            heapq.heapreplace(heap, (sent[heap[0][1]], heap[0][1]))
        src = heap[0][1]
        sent[src] += unit_bytes[u]
        heapq.heapreplace(heap, (sent[src], src))
        out.transfers.append(Transfer(u, src, dst, unit_bytes[u]))
    return out


def assign_nodes(current: ExecutionPlan, layout: ExecutionPlan, profile: ModelProfile,
                 joining: tuple[int, ...] = ()) -> tuple[ExecutionPlan, TransferSchedule]:
    """Put the survivors of ``current`` (and ``joining`` nodes, which hold nothing yet) onto the positions of
    ``layout`` (whose node ids are placeholders) with the fewest bytes to move, and schedule the moves."""
    holdings = {**current.holdings(), **{n: frozenset() for n in joining}}
    survivors = sorted(holdings)
    positions = [(k, i) for k, p in enumerate(layout.pipelines) for i in range(p.length)]
    new_units = [layout.stage_units(k, i) for k, i in positions]
    unit_bytes = [u.state_bytes for u in profile.units()]
    owner, _ = match_positions([holdings[n] for n in survivors], new_units, unit_bytes)
    node_at = {pos: survivors[owner[j]] for j, pos in enumerate(positions)}
    pipes = tuple(
        Pipeline(tuple(Stage(node_at[(k, i)], s.layer_start, s.layer_end) for i, s in enumerate(p.stages)),
                 p.micro_batches)
        for k, p in enumerate(layout.pipelines))
    plan = ExecutionPlan(layout.policy, layout.num_layers, pipes, reason=layout.reason)
    targets = {node_at[pos]: units for pos, units in zip(positions, new_units)}
    return plan, schedule_transfers(holdings, targets, unit_bytes)
