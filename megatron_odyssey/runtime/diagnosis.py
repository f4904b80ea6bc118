"""Who is slow, from what the ranks recorded (C4D, ``shared/papers/c4.txt``): the agent's half of ``op_trace``.

Synchronous training repeats the same operations every step, so an anomaly can be attributed:

- **slow** (non-communication slow): a rank's own compute (or data loading) takes longer than its peers'
  for the same work, and its receivers wait. Each rank's compute per micro-batch (forward, backward and
  weight gradients, without waiting) is divided by what the profile expects for the layers it holds, and
  compared with the ranks holding the same layers (its data-parallel twins), or, where it has none, with
  every other rank: the ratio is its *slowdown factor* in that step. The profile can misjudge one stage's
  layers against another's (the analytic profile of a tiny model does, by 2.5x), which only the comparison
  with other ranks sees: so while a node has twins and keeps pace with them, its ratio to every other rank is
  recorded as its *baseline* for those layers, and once it has lost its twins its factor is that ratio over
  its baseline (a node that lost its data-parallel peer to a failure is not "slow" for holding the embedding).
- **comm-slow** (communication slow): a message handed to the transport on time arrives late. Matching each
  receive with its send gives the delay of every link (source node -> destination node); a link much slower
  than the others is named, and a node all of whose outgoing links are slow is named as the slow one.
- **hang** / **comm-hang** are judged by the agent from progress (``progress_judge.ProgressJudge``): a rank stopped
  in its own work (or whose process stopped) vs one stopped inside a communication its peers never entered.

A node that slept between its operations far longer than its peers for the work it did, or began far more of
its operations after a sleep (it waited on a slow link, or on a slow node's messages), is not judged in that step:
it is a victim, not a cause, and on the CPU an operation right after sleeping reads several times its usual CPU
time (cold caches, a core given to another process or clocked down: 2x after 1 ms and 16x after 100 ms on a quiet
2-core VM, ``benchmarks/bench_cold_after_sleep.py``), which named the ends of a slow link slow too.

One slow step proves nothing on a loaded machine, so a suspect is named when the median of its last ``window``
steps' factors (at least ``needed`` of them) passes the threshold, and is named once. Weak evidence needs more steps:
a node whose median is past the threshold but below ``clear_factor`` is named only when the median of its last
``marginal_window`` steps passes too (a loaded 2-core host can slow one rank's CPU clock 2.1-2.2x for 3 steps, which
named clean ranks in CI; a 4x slowdown reads 3.6-3.9x and is still named after 3). A node is named once: it is
named again only when it has recovered (``recoveries``) and slows down again, or (a slow node) when its factor
changes by half. Pure Python: the agent runs it between commits.
"""
from __future__ import annotations

import statistics
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from ..planning.plan import ExecutionPlan
from ..planning.profile import ModelProfile

KINDS = ("slow", "comm-slow", "hang", "comm-hang")


@dataclass
class Finding:
    step: int
    kind: str  # one of KINDS
    nodes: list[int]
    evidence: str
    factor: float = 1.0  # how many times slower (slow: compute; comm-slow: the link's delay over the others')
    link: tuple[int, int] | None = None  # comm-slow of one link: (source node, destination node)
    delay_s: float = 0.0  # comm-slow: the slow link's median delay per message


@dataclass
class DiagnosisOptions:
    # a rank whose median factor is this many times its peers' is slow: 2, because on a loaded host with
    # hyperthreads even a rank's CPU time per operation can read 1.7x its twins' for 5 steps (seen in CI); in 30 clean
    # runs at load 10-37 no node's median reached 1.5x (one step 1.99x; docs/benchmarks.md, thirty-fifth session)
    slow_factor: float = 2.0
    # ... but a median below this is named only when the median over ``marginal_window`` steps passes the line too:
    # twice in CI (once in about 60 runs, then at the thirty-eighth session's last) a clean rank read 2.1-2.2x for
    # 3 judged steps, the host's noise coming in bursts, while an injected 3x reads 2.8-3.0x and 4x 3.6-3.9x
    # (docs/benchmarks.md, the diagnosis tables)
    clear_factor: float = 2.5
    marginal_window: int = 8
    link_ratio: float = 4.0  # a link whose messages take this many times longer than the others' ...
    link_floor_s: float = 0.05  # ... and at least this long (scheduling on a loaded host delays any message)
    # a node sleeping between its operations, per second of compute, this many times its peers' median, and this
    # much longer per operation, is not judged for compute that step (see ``idled``)
    idle_ratio: float = 3.0
    idle_floor_s: float = 0.002  # (after 1 ms of sleep an operation read 2-4x: bench_cold_after_sleep)
    # ... or a node mostly asleep (this many seconds per second it computed) ...
    asleep_ratio: float = 5.0
    # ... a larger share of whose operations, by this much, began cold (after a sleep: op_trace.COLD_AFTER_S)
    cold_margin: float = 0.3
    window: int = 5  # steps whose median factor is judged
    needed: int = 3  # the fewest steps judged (a new suspect, or one that just came back)


@dataclass
class _Track:
    """One suspect's factors in its recent steps, and whether (with which factor) it was named."""

    seen: deque = field(default_factory=lambda: deque(maxlen=16))  # (step, factor)
    named: float | None = None

    def median(self, window: int) -> float:
        return statistics.median(f for _, f in list(self.seen)[-window:])


class Diagnoser:
    def __init__(self, options: DiagnosisOptions | None = None):
        self.options = options or DiagnosisOptions()
        self.tracks: dict[tuple[str, Any], _Track] = defaultdict(_Track)
        self.last_factors: dict[int, float] = {}  # node -> its compute factor in the newest step
        self.last_idled: set[int] = set()  # nodes not judged in the newest step (they idled: see ``idled``)
        # (node, its units) -> its ratios to every other node in recent steps where twins judged it normal
        self.baselines: dict[tuple[int, frozenset[int]], deque] = defaultdict(lambda: deque(maxlen=16))
        # node -> (its receivers' wait, its all-reduce peers' wait) in each of the steps it is judged on: the
        # evidence of a slow node is that of the window its factor's median comes from, not of one step (on a
        # loaded host one step's order of entry into an all-reduce can be the scheduler's)
        self.held_up: dict[int, deque] = defaultdict(lambda: deque(maxlen=self.options.window))

    # -- per step ---------------------------------------------------------------------------------------
    def observe(self, step: int, summaries: Mapping[int, dict[str, Any]], plan: ExecutionPlan,
                profile: ModelProfile) -> list[Finding]:
        """Take one committed step's summaries (rank -> ``OpTrace.summary`` parsed); returns what is newly
        found (or found again with a factor changed by more than half)."""
        found: list[Finding] = []
        speed, holdings = self.speeds(summaries, plan, profile), plan.holdings()
        idled = self.idled(summaries, holdings)
        factors = self._against_baselines(self.relative_speeds(speed, holdings), speed, holdings, idled)
        waits = self.receive_waits(summaries)
        held_up = self.reduce_waits(summaries)
        self.last_factors, self.last_idled = factors, idled
        for node, factor in factors.items():
            if node in idled:
                continue
            self.held_up[node].append((waits.get(node, 0.0), held_up.get(node, 0.0)))
            found += self._update(("slow", node), step, factor, self.options.slow_factor, lambda m, n=node: Finding(
                step, "slow", [n], _slow_evidence(n, m, list(self.held_up[n])), m))
        links = self.link_delays(summaries)
        for (src, dst), ratio in self.link_ratios(links).items():
            found += self._update(("comm-slow", (src, dst)), step, ratio, self.options.link_ratio,
                                  lambda m, s=src, d=dst: Finding(step, "comm-slow", [s], _link_evidence(s, d, links), m,
                                                                  (s, d), links[(s, d)]))
        return _merge_links(found)

    def recoveries(self) -> list[tuple[str, Any]]:
        """Suspects named before whose last ``needed`` steps all looked normal: (kind, node or link) each,
        once (they may be named again if they slow down again)."""
        out = []
        for key, track in self.tracks.items():
            limit = self.options.slow_factor if key[0] == "slow" else self.options.link_ratio
            if track.named is not None and len(track.seen) >= self.options.needed and \
                    track.median(self.options.needed) < limit:
                track.named = None
                out.append(key)
        return out

    def forget(self, node: int) -> None:
        """The node left the job (dropped, failed): its tracks and baselines go."""
        for key in [k for k in self.tracks if k[1] == node or (isinstance(k[1], tuple) and node in k[1])]:
            del self.tracks[key]
        for key in [k for k in self.baselines if k[0] == node]:
            del self.baselines[key]
        self.held_up.pop(node, None)

    def _against_baselines(self, factors: dict[int, float], speed: dict[int, float],
                           holdings: Mapping[int, frozenset[int]], idled: set[int]) -> dict[int, float]:
        """Record each twinned, normal node's ratio to every other node; judge each twinless node (whose factor
        is that ratio) by it over the median of its baseline where it has one for the layers it holds (one
        judged step is enough: a failure may come at the second step, and any baseline is nearer the truth
        than the profile alone)."""
        out = dict(factors)
        for node, x in speed.items():
            others = [speed[n] for n in speed if n != node]
            if not others or statistics.median(others) <= 0:
                continue
            key = (node, holdings.get(node, frozenset()))
            if any(holdings.get(n) == holdings.get(node) for n in speed if n != node):  # twinned
                if factors.get(node, 1.0) < self.options.slow_factor and node not in idled:
                    self.baselines[key].append(x / statistics.median(others))
            elif self.baselines.get(key):
                out[node] = factors[node] / statistics.median(self.baselines[key])
        return out

    def _update(self, key: tuple[str, Any], step: int, factor: float, limit: float, make) -> list[Finding]:
        track = self.tracks[key]
        track.seen.append((step, factor))
        if len(track.seen) < self.options.needed:
            return []
        median = track.median(self.options.window)
        if key[0] == "slow" and track.named is None and limit <= median < self.options.clear_factor:
            if len(track.seen) < self.options.marginal_window:
                return []  # weak evidence: wait for more steps before believing it
            median = track.median(self.options.marginal_window)
        # named again while still slow only when a node's compute factor changed by half (a new decision);
        # a link's ratio over sub-millisecond delays swings widely, so a slow link is named once per episode
        again = key[0] == "slow" and track.named is not None and abs(median - track.named) > track.named / 2
        if median < limit or (track.named is not None and not again):
            return []
        track.named = median
        return [make(median)]

    # -- the measurements ------------------------------------------------------------------------------
    @staticmethod
    def compute_factors(summaries: Mapping[int, dict[str, Any]], plan: ExecutionPlan,
                        profile: ModelProfile) -> tuple[dict[int, float], dict[int, float]]:
        """Per node: its median forward time over what its layers should take, relative to its twins' (or,
        without twins, every other node's); and how long receivers waited on its messages this step."""
        speed = Diagnoser.speeds(summaries, plan, profile)
        return Diagnoser.relative_speeds(speed, plan.holdings()), Diagnoser.receive_waits(summaries)

    @staticmethod
    def relative_speeds(speed: Mapping[int, float], holdings: Mapping[int, frozenset[int]]) -> dict[int, float]:
        """Each node's speed over the median of its twins' (or, without twins, every other node's)."""
        factors = {}
        for node, x in speed.items():
            others = [speed[n] for n in _peers(node, speed, holdings)]
            if others:
                ref = statistics.median(others)
                factors[node] = x / ref if ref > 0 else 1.0
        return factors

    def idled(self, summaries: Mapping[int, dict[str, Any]], holdings: Mapping[int, frozenset[int]]) -> set[int]:
        """Nodes whose compute this step read colder than their twins' (or, without twins, every other node's)
        because they waited on others: their compute times are not comparable with their peers'. Either

        - they slept between their operations, for each second they computed, far longer (``idle_ratio``) than
          their peers, and longer by ``idle_floor_s`` per operation. Per second of compute: a slow node sleeps too
          on a host it crowds (its peers wait for a core, and it for them), but it computes longest (the
          bottleneck is the busiest), while a link's ends and a slow node's receivers mostly wait; or
        - they were mostly asleep (``asleep_ratio`` seconds per second of compute) and a larger share of their
          operations (by ``cold_margin``) began cold, after a sleep. When a slow link stalls every pipeline all ranks
          sleep alike in total, but its ends wait before nearly every operation while their twins wait a few times,
          long, and then run warm (Megatron-LM's interleaved schedule, a 150x link on a 2-core host: 11-13 of 15
          operations against 4-6, and the ends' compute read 1.2-3.8x their twins'). Mostly asleep too: in a clean run
          a node's share swings from step to step, but it sleeps about as long as it computes (median 1.2x; of a
          clean 50-step run's 294 node-steps, none met both conditions), and a slow node, the bottleneck, sleeps
          least of all."""
        per_op: dict[int, float] = {}
        per_compute: dict[int, float] = {}
        cold: dict[int, float] = {}
        for s in summaries.values():
            node, ops = int(s["node"]), s["f"][0] + s["b"][0]
            idle = float(s.get("idle", 0.0))
            computed = s["c"] * s["f"][0] / ops if ops else 0.0  # seconds per operation
            per_op[node] = max(per_op.get(node, 0.0), idle)
            per_compute[node] = max(per_compute.get(node, 0.0), idle / computed if computed > 0 else 0.0)
            cold[node] = max(cold.get(node, 0.0), float(s.get("cold", 0.0)))
        out = set()
        for node in per_op:
            others = _peers(node, per_op, holdings)
            if not others:
                continue
            slept_longer = per_compute[node] > self.options.idle_ratio * statistics.median(
                per_compute[n] for n in others) and per_op[node] - statistics.median(
                per_op[n] for n in others) > self.options.idle_floor_s
            began_colder = per_compute[node] >= self.options.asleep_ratio and \
                cold[node] - statistics.median(cold[n] for n in others) >= self.options.cold_margin
            if slept_longer or began_colder:
                out.add(node)
        return out

    @staticmethod
    def receive_waits(summaries: Mapping[int, dict[str, Any]]) -> dict[int, float]:
        """node -> how long receivers waited on its messages this step."""
        waits: dict[int, float] = defaultdict(float)
        for s in summaries.values():
            for src, _, entered, done in s["rx"]:
                waits[int(src)] += done - entered
        return dict(waits)

    @staticmethod
    def speeds(summaries: Mapping[int, dict[str, Any]], plan: ExecutionPlan, profile: ModelProfile) -> dict[int, float]:
        """node -> its measured compute per micro-batch over what the profile expects for its layers (the
        slowest of its TP ranks)."""
        units = profile.units()
        holdings = plan.holdings()
        speed: dict[int, float] = {}
        for s in summaries.values():
            node = int(s["node"])
            expected = sum(units[u].forward_s + units[u].backward_s for u in holdings.get(node, ()))
            if s["f"][0] and expected > 0:
                speed[node] = max(speed.get(node, 0.0), s["c"] / expected)
        return speed

    @staticmethod
    def reduce_waits(summaries: Mapping[int, dict[str, Any]]) -> dict[int, float]:
        """Per node, how long its gradient all-reduce peers waited for it this step: in each unit's all-reduce
        the last to enter holds up the others (C4D), by the time between its entry and the others' median."""
        entries: dict[int, list[tuple[float, int]]] = defaultdict(list)
        for s in summaries.values():
            for unit, entered, _ in s.get("ar", []):
                entries[int(unit)].append((entered, int(s["node"])))
        out: dict[int, float] = defaultdict(float)
        for group in entries.values():
            if len(group) > 1:
                group.sort()
                last, node = group[-1]
                out[node] += last - statistics.median(t for t, _ in group[:-1])
        return dict(out)

    @staticmethod
    def link_delays(summaries: Mapping[int, dict[str, Any]]) -> dict[tuple[int, int], float]:
        """Median delay of each link (source node -> destination node) this step: from the send being handed
        over (or the receiver starting to wait, whichever is later) to the data being there."""
        sent = {}
        for s in summaries.values():
            for dst, name, t in s["tx"]:
                sent[(int(s["node"]), int(dst), name)] = t
        delays: dict[tuple[int, int], list[float]] = defaultdict(list)
        for s in summaries.values():
            dst = int(s["node"])
            for src, name, entered, done in s["rx"]:
                t = sent.get((int(src), dst, name))
                if t is not None:
                    delays[(int(src), dst)].append(max(0.0, done - max(t, entered)))
        return {link: statistics.median(d) for link, d in delays.items()}

    def link_ratios(self, delays: Mapping[tuple[int, int], float]) -> dict[tuple[int, int], float]:
        """Each link's delay over the median of the other sources' links (1 for links faster than the floor:
        any message can be held up that long on a loaded host)."""
        out = {}
        for (src, dst), d in delays.items():
            others = [v for (s, _), v in delays.items() if s != src]
            ref = statistics.median(others) if others else 0.0
            out[(src, dst)] = 1.0 if d < self.options.link_floor_s else (d / ref if ref > 0 else 1e9)
        return out


def judged_summary(steps: Iterable[Mapping[str, Any]]) -> str | None:
    """One line on how much of the job the diagnosis judged, from the agent's step records (``slowest``: the step
    was judged; ``idled``: the nodes left out of it): a user whose slow node was never named can see whether it
    was judged at all. None when no step was."""
    judged = [s for s in steps if "slowest" in s or s.get("idled")]
    if not judged:
        return None
    left: dict[int, int] = defaultdict(int)
    for s in judged:
        for node in s.get("idled", ()):
            left[node] += 1
    text = f"diagnosis: judged the nodes' compute in {len(judged)} step{'s' if len(judged) != 1 else ''}"
    if left:
        text += ("; left out of some, as waiting on others (their compute read cold): " +
                 ", ".join(f"node {n} in {k} of them" for n, k in sorted(left.items())))
    return text


def _peers(node: int, nodes: Iterable[int], holdings: Mapping[int, frozenset[int]]) -> list[int]:
    """Whom ``node`` is compared with: its twins (the nodes holding the same layers), or, without twins, every other
    node."""
    others = [n for n in nodes if n != node]
    return [n for n in others if holdings.get(n) == holdings.get(node)] or others


def _slow_evidence(node: int, factor: float, held_up: list[tuple[float, float]]) -> str:
    """What the node's slowness cost the others over the steps it was judged on: ``held_up`` is (its receivers'
    wait, its all-reduce peers' wait) per step."""
    text = f"node {node}'s compute per micro-batch takes {factor:.1f}x as long as its peers' for the same work"
    steps = len(held_up)
    waited = sum(w for w, _ in held_up)
    if waited:
        text += f"; its receivers waited {waited * 1e3:.0f} ms for its messages in the last {steps} steps"
    late = [r for _, r in held_up if r]
    if late:
        text += (f"; its gradient all-reduce peers waited {sum(late) * 1e3:.0f} ms for it (it entered last in "
                 f"{len(late)} of those {steps} steps)")
    return text


def _link_evidence(src: int, dst: int, delays: Mapping[tuple[int, int], float]) -> str:
    others = [v for (s, _), v in delays.items() if s != src]
    ref = f"{statistics.median(others) * 1e3:.1f} ms on other links" if others else "no other link to compare"
    return (f"messages from node {src} to node {dst} arrive {delays[(src, dst)] * 1e3:.1f} ms after being sent "
            f"(median), {ref}; node {src}'s compute is normal")


def _merge_links(found: list[Finding]) -> list[Finding]:
    """Several slow links from one source in the same step: that source's links are slow (one finding)."""
    by_src: dict[int, list[Finding]] = defaultdict(list)
    out = []
    for f in found:
        (by_src[f.nodes[0]] if f.kind == "comm-slow" else out).append(f)
    for src, fs in by_src.items():
        if len(fs) == 1:
            out.append(fs[0])
        else:
            out.append(Finding(fs[0].step, "comm-slow", [src], f"every link out of node {src} is slow: "
                               + "; ".join(f.evidence for f in fs), max(f.factor for f in fs),
                               delay_s=statistics.median(f.delay_s for f in fs)))
    return out
