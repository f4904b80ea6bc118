"""Oobleck's pipeline templates (§4.1.2): for each node count n, one fixed layer-to-stage mapping
and the pipeline's iteration time, both from the planning profile's per-layer costs.

``sim/oobleck.py`` asks for ``pipeline_time(n, m)`` thousands of times while it distributes batches
and enumerates instantiations, so this must be cheap. A template's mapping is chosen once per n
(templates "never change during the entire training", §3.3): the contiguous split into n stages
(one node each, TP inside the node; embedding on the first stage, output layer on the last) that
minimises the slowest stage, subject to Eq. 14 memory with the deepest 1F1B in-flight count
(stage i of n holds n - i micro-batches), found by dynamic programming. Its time for m micro-batches
is Oobleck's critical-path decomposition T1 + T2 + T3 (Figure 5): every stage's F+B once, the
slowest stage's F+B for the remaining m - 1 micro-batches, and the activation hops:

    T(n, m) = sum_i (F_i + B_i) + (m - 1) * max_i (F_i + B_i) + 2 (n - 1) p2p

which is Eq. 9 exactly for identical stages. (The simulator then times the instantiated pipelines
with the planning estimator, like every policy; this model only steers Oobleck's own choices.)
"""
from __future__ import annotations

import math

import numpy as np

from ..planning.profile import ModelProfile


class TemplateModel:
    def __init__(self, profile: ModelProfile):
        self.profile = profile
        L = profile.num_layers
        c = np.array([u.forward_s + u.backward_s for u in profile.layers])
        self.cum_c = np.concatenate([[0.0], np.cumsum(c)])
        self.cum_static = np.concatenate([[0.0], np.cumsum([u.static_bytes for u in profile.layers])])
        self.cum_act = np.concatenate([[0.0], np.cumsum([u.activation_bytes for u in profile.layers])])
        self.L = L
        self._splits: dict[int, tuple[tuple[int, ...], tuple[float, ...]] | None] = {}

    def _stage(self, a: np.ndarray | int, b: int, first: bool, last: bool, in_flight: int):
        """Cost and memory fit of stages covering layers [a, b) (a may be an array of starts)."""
        p = self.profile
        cost = self.cum_c[b] - self.cum_c[a]
        static = self.cum_static[b] - self.cum_static[a]
        act = self.cum_act[b] - self.cum_act[a]
        if first:
            cost = cost + p.embedding.forward_s + p.embedding.backward_s
            static, act = static + p.embedding.static_bytes, act + p.embedding.activation_bytes
        if last:
            cost = cost + p.output.forward_s + p.output.backward_s
            static, act = static + p.output.static_bytes, act + p.output.activation_bytes
        fits = static + in_flight * act <= p.device_memory_bytes
        return cost, fits

    def template(self, n: int) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
        """(layers per stage, F+B per stage) of the n-node template, or None if none fits memory."""
        if n in self._splits:
            return self._splits[n]
        L = self.L
        if n < 1 or n > L:
            self._splits[n] = None
            return None
        inf = math.inf
        best = np.full((n, L + 1), inf)  # best[i][b]: least slowest-stage cost, stages 0..i covering [0, b)
        arg = np.zeros((n, L + 1), dtype=int)
        for b in range(1, L + 1):
            cost, fits = self._stage(0, b, True, n == 1 and b == L, n)
            if fits:
                best[0, b] = cost
        for i in range(1, n):
            last = i == n - 1
            for b in range(i + 1, L + 1):
                if last and b != L:
                    continue
                a = np.arange(i, b)
                cost, fits = self._stage(a, b, False, last, n - i)
                cand = np.where(fits, np.maximum(best[i - 1, a], cost), inf)
                k = int(np.argmin(cand))
                best[i, b], arg[i, b] = cand[k], a[k]
        if not math.isfinite(best[n - 1, L]):
            self._splits[n] = None
            return None
        bounds, b = [L], L
        for i in range(n - 1, 0, -1):
            b = int(arg[i, b])
            bounds.append(b)
        bounds.append(0)
        bounds.reverse()
        split = tuple(bounds[i + 1] - bounds[i] for i in range(n))
        costs = tuple(float(self._stage(bounds[i], bounds[i + 1], i == 0, i == n - 1, n - i)[0]) for i in range(n))
        self._splits[n] = (split, costs)
        return self._splits[n]

    def pipeline_time(self, n: int, m: int) -> float:
        """T1 + T2 + T3 of the n-node template for m micro-batches (inf if no template fits)."""
        t = self.template(n)
        if t is None:
            return math.inf
        _, costs = t
        return sum(costs) + (m - 1) * max(costs) + 2 * (n - 1) * self.profile.p2p_s

    def min_nodes(self) -> int | None:
        return next((n for n in range(1, self.L + 1) if self.template(n) is not None), None)
