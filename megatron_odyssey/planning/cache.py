"""Plan cache (Odyssey revision IV-A): decisions for every failure of up to ``k`` nodes, computed
ahead of time during fault-free training, so the decision at failure time is a dictionary lookup.

Pipelines with the same layer split and micro-batch count are interchangeable, so failure sets that
differ only by which of those pipelines they hit share one search; the stored decision is relabelled
(pipelines permuted) for each concrete failure set. Single failures are materialised eagerly,
larger sets on first lookup.
"""
from __future__ import annotations

from dataclasses import replace
from itertools import combinations
from typing import Callable, Iterable

from .estimator import score
from .plan import ExecutionPlan, Pipeline, Reroute, Stage
from .planner import Candidate, Decision, Planner
from .restorer import Transfer, TransferSchedule

FailureKey = tuple[tuple[tuple, tuple[int, ...]], ...]


class PlanCache:
    def __init__(self, planner: Planner, current: ExecutionPlan, max_failures: int = 1):
        if max_failures < 0:
            raise ValueError(f"max_failures must be >= 0, got {max_failures}")
        self.planner = planner
        self.current = current
        self.max_failures = max_failures
        self._symmetric = not current.failed and not current.reroutes
        pos = current.position_of()
        self._pos = pos
        self._sig = [(p.layer_split(), p.micro_batches) for p in current.pipelines]
        self._canonical: dict[FailureKey, tuple[frozenset[int], Decision]] = {}
        self._concrete: dict[frozenset[int], Decision] = {}

    # -- keys -------------------------------------------------------------------------------------
    def key(self, failed: Iterable[int]) -> FailureKey | frozenset[int]:
        failed = frozenset(failed)
        if not self._symmetric:
            return failed
        hit: dict[int, list[int]] = {}
        for n in failed:
            k, i = self._pos[n]
            hit.setdefault(k, []).append(i)
        return tuple(sorted((self._sig[k], tuple(sorted(stages))) for k, stages in hit.items()))

    def _representative_sets(self, size: int) -> Iterable[frozenset[int]]:
        """One failure set per equivalence class (a superset of classes, deduplicated by key)."""
        if not self._symmetric:
            yield from (frozenset(c) for c in combinations(self.current.live_nodes(), size))
            return
        by_class: dict[tuple, list[int]] = {}
        for k, sig in enumerate(self._sig):
            by_class.setdefault(sig, []).append(k)
        nodes = [s.node for ks in by_class.values() for k in ks[:size] for s in self.current.pipelines[k].stages]
        yield from (frozenset(c) for c in combinations(sorted(nodes), size))

    # -- fill and look up -------------------------------------------------------------------------
    def precompute(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Search every failure class up to ``max_failures``; returns the number of searches run."""
        todo: list[frozenset[int]] = []
        seen = set(self._canonical)
        for size in range(1, self.max_failures + 1):
            for failed in self._representative_sets(size):
                key = self.key(failed)
                if key not in seen:
                    seen.add(key)
                    todo.append(failed)
        for done, failed in enumerate(todo, 1):
            self._store(failed, self.planner.decide(self.current, failed))
            if progress:
                progress(done, len(todo))
        for node in self.current.live_nodes():  # O(1) lookups for the common case
            self.lookup({node})
        return len(todo)

    def _store(self, failed: frozenset[int], decision: Decision) -> None:
        self._canonical[self.key(failed)] = (failed, decision)

    def lookup(self, failed: Iterable[int]) -> Decision | None:
        failed = frozenset(failed)
        hit = self._concrete.get(failed)
        if hit is not None:
            return hit
        entry = self._canonical.get(self.key(failed))
        if entry is None:
            return None
        canonical_failed, decision = entry
        mapping = self._node_mapping(canonical_failed, failed) if self._symmetric else {}
        out = _relabel_decision(decision, mapping)
        self._concrete[failed] = out
        return out

    def __len__(self) -> int:
        return len(self._canonical)

    def _node_mapping(self, src_failed: frozenset[int], dst_failed: frozenset[int]) -> dict[int, int]:
        """Permutation of pipelines (within each signature class) taking src's failures onto dst's."""
        def hit_pipelines(failed: frozenset[int]) -> dict[int, tuple[int, ...]]:
            out: dict[int, list[int]] = {}
            for n in failed:
                k, i = self._pos[n]
                out.setdefault(k, []).append(i)
            return {k: tuple(sorted(v)) for k, v in out.items()}

        src_hit, dst_hit = hit_pipelines(src_failed), hit_pipelines(dst_failed)
        perm: dict[int, int] = {}
        groups: dict[tuple, tuple[list[int], list[int]]] = {}
        for k, stages in src_hit.items():
            groups.setdefault((self._sig[k], stages), ([], []))[0].append(k)
        for k, stages in dst_hit.items():
            groups.setdefault((self._sig[k], stages), ([], []))[1].append(k)
        for src_ks, dst_ks in groups.values():
            perm.update(zip(sorted(src_ks), sorted(dst_ks)))
        for sig in set(self._sig):
            members = [k for k, s in enumerate(self._sig) if s == sig]
            free_src = [k for k in members if k not in src_hit]
            free_dst = [k for k in members if k not in dst_hit]
            perm.update(zip(free_src, free_dst))
        mapping = {}
        for k, pipe in enumerate(self.current.pipelines):
            for i, stage in enumerate(pipe.stages):
                mapping[stage.node] = self.current.pipelines[perm[k]].stages[i].node
        return mapping


def _relabel_plan(plan: ExecutionPlan | None, m: dict[int, int]) -> ExecutionPlan | None:
    if plan is None or not m:
        return plan
    pipes = tuple(Pipeline(tuple(Stage(m.get(s.node, s.node), s.layer_start, s.layer_end) for s in p.stages),
                           p.micro_batches) for p in plan.pipelines)
    return replace(plan, pipelines=pipes, failed=frozenset(m.get(n, n) for n in plan.failed),
                   reroutes=tuple(Reroute(r.pipeline, r.stage, r.micro_batch, m.get(r.peer, r.peer))
                                  for r in plan.reroutes))


def _relabel_transfers(t: TransferSchedule | None, m: dict[int, int]) -> TransferSchedule | None:
    if t is None or not m:
        return t
    return TransferSchedule([Transfer(x.unit, m.get(x.src, x.src), m.get(x.dst, x.dst), x.nbytes) for x in t.transfers])


def _relabel_decision(d: Decision, m: dict[int, int]) -> Decision:
    """The decision for the relabelled failure set, with no search time (it was paid ahead)."""
    candidates = []
    chosen = None
    for c in d.candidates:
        trans = replace(c.transition, search_s=0.0)
        step = c.step and replace(c.step, peak_memory_bytes={m.get(n, n): b for n, b in c.step.peak_memory_bytes.items()})
        new = Candidate(c.policy, _relabel_plan(c.plan, m), step, trans, _relabel_transfers(c.transfers, m), c.reason)
        if new.feasible:
            new.score = score(d.global_batch, new.step_time_s, trans.total_s, d.time_to_next_failure_s)
        candidates.append(new)
        if c is d.chosen:
            chosen = new
    assert chosen is not None
    return Decision(d.policy, chosen, candidates, 0.0, d.time_to_next_failure_s, d.global_batch,
                    frozenset(m.get(n, n) for n in d.failed), cached=True)

