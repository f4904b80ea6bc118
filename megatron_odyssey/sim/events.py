"""Failure and return processes: what happens to the cluster, independent of any policy.

Every policy of one seed sees the same event stream (common random numbers), so differences
between policies come from the policies, not from luck. Three processes:

* ``poisson_events``: each device fails at a constant rate (failures per device-hour, the
  Odyssey paper's "10% per NPU-hour"); a node (one TP group) dies with its first device, so a
  node's lifetime is exponential with rate ``tp * rate``. Failed nodes do not come back.
* ``interval_events``: one failure every ``interval`` on average for the whole cluster (ReCycle's
  and Oobleck's "one failure every 6 h / 2 h / 30 min"); the victim is a uniformly chosen live
  node.
* ``trace_events``: replay of a spot-instance trace; nodes leave and come back.

``add_fail_slow`` lays fail-slow episodes (``failslow.py``) over any of them: live nodes become slower by a
factor and later recover. It draws from its own random stream, so the failures of a seed are the same with and
without fail-slow, and every policy of a seed sees the same slow episodes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from .failslow import SlowClass
from .traces import Trace

_SLOW_STREAM = 0x51_0E  # keeps the fail-slow draws apart from the failure draws of the same seed


@dataclass(frozen=True)
class ClusterEvent:
    """Nodes that left and nodes that (re)joined at one instant (simultaneous trace lines merge), and live
    nodes whose slowdown factor changed then (``(node, factor)``; 1.0: back at full speed)."""

    time_s: float
    removed: frozenset[int] = frozenset()
    added: frozenset[int] = frozenset()
    slowdown: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class EventStream:
    """The cluster's history for one seed: who is there at t=0 and what changes until the horizon."""

    initial: frozenset[int]
    events: tuple[ClusterEvent, ...]
    horizon_s: float
    node_names: dict[int, str] = field(default_factory=dict)

    def alive_at_end(self) -> frozenset[int]:
        alive = set(self.initial)
        for e in self.events:
            alive -= e.removed
            alive |= e.added
        return frozenset(alive)


def poisson_events(num_nodes: int, tp: int, rate_per_device_hour: float, horizon_s: float,
                   seed: int) -> EventStream:
    """Independent exponential lifetimes, one per node, with rate ``tp * rate`` per hour."""
    rng = np.random.default_rng(seed)
    node_rate_per_s = tp * rate_per_device_hour / 3600.0
    events = []
    if node_rate_per_s > 0:
        lifetimes = rng.exponential(1.0 / node_rate_per_s, size=num_nodes)
        for node in np.argsort(lifetimes, kind="stable"):
            t = float(lifetimes[node])
            if t >= horizon_s:
                break
            events.append(ClusterEvent(t, removed=frozenset({int(node)})))
    return EventStream(frozenset(range(num_nodes)), tuple(events), horizon_s)


def interval_events(num_nodes: int, mean_interval_s: float, horizon_s: float, seed: int) -> EventStream:
    """A cluster-level Poisson process of failures with the given mean interval; each failure
    removes one live node chosen uniformly. Stops when no node is left."""
    rng = np.random.default_rng(seed)
    alive = list(range(num_nodes))
    events = []
    t = 0.0
    while alive:
        t += float(rng.exponential(mean_interval_s))
        if t >= horizon_s:
            break
        victim = alive.pop(int(rng.integers(len(alive))))
        events.append(ClusterEvent(t, removed=frozenset({victim})))
    return EventStream(frozenset(range(num_nodes)), tuple(events), horizon_s)


def trace_events(trace: Trace, horizon_s: float, seed: int | None = None) -> EventStream:
    """Replay ``trace`` up to ``horizon_s``. Names map to integer ids; with a seed the mapping is a
    random permutation, which randomises which grid position each node takes (the only randomness
    in a replay). Lines with the same timestamp form one event (their net effect)."""
    names = list(trace.node_names)
    ids = list(range(len(names)))
    if seed is not None:
        ids = [int(i) for i in np.random.default_rng(seed).permutation(len(names))]
    id_of = dict(zip(names, ids))
    alive: set[int] = set()
    initial: frozenset[int] | None = None
    events: list[ClusterEvent] = []
    i, evs = 0, trace.events
    while i < len(evs):
        t = evs[i].time_s
        if t > 0 and initial is None:
            initial = frozenset(alive)
        if t >= horizon_s:
            break
        before = set(alive)
        while i < len(evs) and evs[i].time_s == t:
            (alive.add if evs[i].op == "add" else alive.discard)(id_of[evs[i].node])
            i += 1
        if t > 0:
            removed, added = frozenset(before - alive), frozenset(alive - before)
            if removed or added:
                events.append(ClusterEvent(t, removed, added))
    if initial is None:
        initial = frozenset(alive)
    return EventStream(initial, tuple(events), horizon_s, {v: k for k, v in id_of.items()})


# -- fail-slow -----------------------------------------------------------------------------------------

def slow_episodes(node: int, classes: tuple[SlowClass, ...], tp: int, horizon_s: float,
                  seed: int) -> list[tuple[float, float, float, int]]:
    """``(start_s, end_s, factor, class index)`` of every fail-slow episode of ``node`` before the horizon,
    whether or not the node is alive then. One random stream per (seed, class, node), so adding a node or a
    class does not change the others' episodes."""
    out = []
    for k, c in enumerate(classes):
        rate_per_s = tp * c.rate_per_device_hour / 3600.0
        if rate_per_s <= 0:
            continue
        rng = np.random.default_rng([seed, _SLOW_STREAM, k, node])
        t = 0.0
        while True:
            t += float(rng.exponential(1.0 / rate_per_s))
            if t >= horizon_s:
                break
            factor = c.factors[int(rng.integers(len(c.factors)))]
            d = math.inf if c.mean_duration_h is None else float(rng.exponential(c.mean_duration_h * 3600.0))
            out.append((t, t + d, factor, k))
            t += d
    return out


def _factor_at(episodes: list[tuple[float, float, float, int]], t: float) -> float:
    """The node's slowdown at ``t``: the product of its active episodes' factors (compound fail-slows)."""
    f = 1.0
    for start, end, factor, _ in episodes:
        if start <= t < end:
            f *= factor
    return f


def add_fail_slow(stream: EventStream, classes: tuple[SlowClass, ...], tp: int, seed: int) -> EventStream:
    """``stream`` with fail-slow episodes of ``classes`` laid over it: an event wherever a live node's factor
    changes. A node that leaves is no longer slow; one that (re)joins during an episode joins slow."""
    if not classes:
        return stream
    nodes = sorted(set(stream.initial).union(*(e.added for e in stream.events)))
    episodes = {n: slow_episodes(n, classes, tp, stream.horizon_s, seed) for n in nodes}
    changes: dict[float, set[int]] = {}
    for n, eps in episodes.items():
        for start, end, _, _ in eps:
            for t in (start, end):
                if t < stream.horizon_s:
                    changes.setdefault(t, set()).add(n)
    alive = set(stream.initial)
    factor: dict[int, float] = {}  # live nodes' factors as the stream has announced them
    out: list[ClusterEvent] = []

    def announce(t: float, candidates: set[int]) -> tuple[tuple[int, float], ...]:
        diff = []
        for n in sorted(candidates & alive):
            f = _factor_at(episodes[n], t)
            if f != factor.get(n, 1.0):
                diff.append((n, f))
                if f == 1.0:
                    factor.pop(n, None)
                else:
                    factor[n] = f
        return tuple(diff)

    cluster = {e.time_s: e for e in stream.events}  # (one event per instant: simultaneous changes merge)
    for t in sorted(set(changes) | set(cluster)):
        e = cluster.get(t)
        candidates = set(changes.get(t, ()))
        if e is not None:
            alive -= e.removed
            alive |= e.added
            for n in e.removed:
                factor.pop(n, None)
            candidates |= e.added
        diff = announce(t, candidates)
        if e is not None:
            out.append(replace(e, slowdown=diff))
        elif diff:
            out.append(ClusterEvent(t, slowdown=diff))
    return replace(stream, events=tuple(out))
