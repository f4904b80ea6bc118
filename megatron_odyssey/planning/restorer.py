"""Restorer algorithms (Odyssey IV-B): which survivor takes which new position and where its missing
layers come from (min-cost bipartite matching), and in how many rounds the per-layer gradient
all-reduces of an asymmetric layout can run (graph colouring).
"""
from __future__ import annotations

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


def transfer_cost_matrix(old: list[frozenset[int]], new: list[frozenset[int]], unit_bytes: list[int]) -> np.ndarray:
    """cost[i][j] = bytes node i must fetch to take new position j (what it lacks; extras are dropped).

    Computed once per distinct (holding, position) pair: a big cluster has only a few of each."""
    old_classes: dict[frozenset[int], int] = {}
    new_classes: dict[frozenset[int], int] = {}
    old_idx = [old_classes.setdefault(u, len(old_classes)) for u in old]
    new_idx = [new_classes.setdefault(u, len(new_classes)) for u in new]
    small = np.zeros((len(old_classes), len(new_classes)))
    for have, a in old_classes.items():
        for need, b in new_classes.items():
            small[a, b] = sum(unit_bytes[u] for u in need - have)
    return small[np.ix_(np.asarray(old_idx), np.asarray(new_idx))]


def match_positions(old: list[frozenset[int]], new: list[frozenset[int]], unit_bytes: list[int]) -> tuple[list[int], float]:
    """Kuhn-Munkres matching of survivors to new positions; returns (survivor index per position, cost)."""
    if len(old) != len(new):
        raise PlanningError(f"{len(old)} survivors cannot fill {len(new)} positions")
    cost = transfer_cost_matrix(old, new, unit_bytes)
    rows, cols = linear_sum_assignment(cost)
    owner = [0] * len(new)
    for r, c in zip(rows, cols):
        owner[c] = r
    return owner, float(cost[rows, cols].sum())


def schedule_transfers(holdings: dict[int, frozenset[int]], targets: dict[int, frozenset[int]],
                       unit_bytes: list[int]) -> TransferSchedule:
    """For every unit a node needs and lacks, pick a live holder, spreading send load over holders."""
    holders: dict[int, list[int]] = {}
    for node, units in holdings.items():
        for u in units:
            holders.setdefault(u, []).append(node)
    sent: dict[int, int] = {n: 0 for n in holdings}
    out = TransferSchedule()
    wanted = sorted(((u, dst) for dst, units in targets.items() for u in units - holdings.get(dst, frozenset())),
                    key=lambda x: (-unit_bytes[x[0]], x[0], x[1]))
    for u, dst in wanted:
        sources = holders.get(u)
        if not sources:
            raise PlanningError(f"unit {u} has no live copy: cannot be transferred to node {dst}")
        src = min(sources, key=lambda n: (sent[n], n))
        sent[src] += unit_bytes[u]
        out.transfers.append(Transfer(u, src, dst, unit_bytes[u]))
    return out


def assign_nodes(current: ExecutionPlan, layout: ExecutionPlan, profile: ModelProfile) -> tuple[ExecutionPlan, TransferSchedule]:
    """Put the survivors of ``current`` onto the positions of ``layout`` (whose node ids are
    placeholders) with the fewest bytes to move, and schedule the moves."""
    holdings = current.holdings()
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
