"""The decision centre: given the current plan and the failed nodes, build the best plan of each
policy (reroute, reconfigure, restart), estimate them, and choose by Eq. 8.

Reconfiguration follows Odyssey's Algorithm 1: enumerate ways to split the survivors into pipelines
(DP within +-``dp_range`` of the current DP, lengths within a PP range), distribute the batch,
split the layers, estimate, keep the fastest. ``search="exhaustive"`` enumerates every pipeline
count and length, every batch split and every layer split instead: an oracle for small clusters.
"""
from __future__ import annotations

import math
import time
from itertools import islice
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from .errors import PlanningError
from .estimator import StepEstimate, allreduce_time, estimate_step, restart_risk, score
from .exhaustive import ExhaustiveSearch, SearchStatus, batch_splits
from .partition import (CHEAP_PLAY_SLOTS, PipelineModel, balanced_multisets, distribute_batch, length_multisets,
                        max_units, split_front, split_layers)
from .plan import ExecutionPlan, Reroute, layout
from .profile import ModelProfile
from .normalise import normalised_grid
from .restorer import TransferSchedule, assign_nodes, schedule_transfers

SEARCH_MODES = ("heuristic", "exhaustive")
FEW_PIPELINES = 4  # layouts of at most this many pipelines may try every batch split (_few_pipeline_batches)
# Llama 3 (Grattafiori et al. 2024) saw 419 interruptions in 54 days on 16,384 GPUs: about 50,000
# device-hours between failures of one device.
DEFAULT_MTBF_HOURS = 50_000.0


@dataclass(frozen=True)
class PlannerOptions:
    search: str = "heuristic"
    dp_range: int = 2  # new DP within +-dp_range of the current one (the paper's observation)
    pp_range: int = 2  # pipeline lengths within +-pp_range of the current length ...
    mtbf_hours: float = DEFAULT_MTBF_HOURS  # per device; the next failure is expected after mtbf / devices
    max_multisets_per_dp: int = 2000  # past this, only balanced multisets (two adjacent lengths)
    refine_top: int = 8  # candidates that get the full estimate (sync + optimizer) and batch refinement
    min_pipelines: int = 2  # layouts that keep a live replica of every layer (see search_layouts)
    # Eq. 8 charges each candidate the expected restart its next failure forces (estimator.restart_risk);
    # False: instead never choose fewer than min_pipelines pipelines when the survivors allow
    price_restart_risk: bool = True
    failure_bursts: tuple[tuple[int, float], ...] = ((1, 1.0),)  # (nodes lost together, probability) per event
    unit_balance_top: int = 4  # of those, how many also try capping units per node (fewer sync rounds)
    screen_top: int = 3  # pipeline counts outside the DP window evaluated after the closed-form screen
    transfer_top: int = 6  # of the fastest layouts, how many get their transfers planned and Eq. 8 scored
    few_batch_splits: int = 64  # layouts with at most this many batch splits try every one of them
    unit_balance_batches: int = 3  # ... and the fastest this many of those also try capping units per node
    cheap_play_slots: int = CHEAP_PLAY_SLOTS  # screened pipeline counts and every-batch-split tries: only where a
    #                                           pipeline plays at most this many stage x micro-batch slots
    fill: bool = True  # also offer the bubble-filling reroute (decoupled backward)
    stagger: bool = True  # ... and that reroute with the staggered optimizer (when the host can run it)
    normalise: bool = True  # also offer ReCycle's failure normalisation (a few nodes change stage, then reroute)
    tp: int = 1
    time_limit_s: float | None = None  # exhaustive search: stop here and keep the best layout found so far
    search_budget_s: float | None = 60.0  # exhaustive search without a time limit: refuse past this estimate

    def __post_init__(self) -> None:
        if self.search not in SEARCH_MODES:
            raise PlanningError(f"--search must be one of {SEARCH_MODES}, got {self.search!r}")
        if not self.mtbf_hours > 0:
            raise PlanningError(f"--mtbf-hours must be positive, got {self.mtbf_hours}")
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise PlanningError(f"--time-limit must be positive seconds, got {self.time_limit_s}")
        if (not self.failure_bursts or any(not isinstance(k, int) or k < 1 or not 0 <= p <= 1 for k, p in self.failure_bursts)
                or abs(sum(p for _, p in self.failure_bursts) - 1) > 1e-6):
            raise PlanningError(f"failure_bursts must be (nodes >= 1, probability) pairs whose probabilities sum to 1, "
                                f"got {self.failure_bursts!r}")


@dataclass
class Transition:
    search_s: float = 0.0
    transfer_s: float = 0.0
    overhead_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.search_s + self.transfer_s + self.overhead_s


@dataclass
class Candidate:
    policy: str
    plan: ExecutionPlan | None
    step: StepEstimate | None = None
    transition: Transition = field(default_factory=Transition)
    transfers: TransferSchedule | None = None
    reason: str = ""
    score: float = 0.0
    restart_risk_s: float = 0.0  # expected cost of the restart the next failure may force (Eq. 8 extension)
    tag: str = ""  # a kind of its own (``standby-fill``, ``standby-reconfigure``: standby nodes put to work)

    @property
    def feasible(self) -> bool:
        return self.plan is not None and self.step is not None

    @property
    def step_time_s(self) -> float:
        return self.step.step_time_s if self.step else math.inf

    @property
    def fill(self) -> bool:
        """A reroute that fills pipeline bubbles (decoupled backward, ``ExecutionPlan.fill``)."""
        return self.plan is not None and self.plan.fill

    @property
    def stagger(self) -> bool:
        """A filled reroute whose ranks update before the commit (ReCycle's staggered optimizer, ``ExecutionPlan.stagger``)."""
        return self.plan is not None and self.plan.stagger

    @property
    def kind(self) -> str:
        """The policy, with the filled reroute ('fill'), the filled reroute with the staggered optimizer
        ('stagger') and the normalised reroute ('normalise': a reconfiguration that keeps dead nodes' places
        and reroutes their work) told apart: what --policy forces."""
        if self.tag:
            return self.tag
        if self.policy == "reroute":
            return ("stagger" if self.stagger else "fill") if self.fill else "reroute"
        if self.policy == "reconfigure" and self.plan is not None and self.plan.reroutes:
            return "normalise"
        return self.policy

    @property
    def label(self) -> str:
        """How reports name the candidate (``policy_label``)."""
        return policy_label(self.kind, self.fill, self.stagger)

    def summary(self) -> dict[str, Any]:
        return {"policy": self.policy, "kind": self.kind, "fill": self.fill, "stagger": self.stagger,
                "step_time_s": _finite(self.step_time_s),
                "restart_risk_s": self.restart_risk_s,
                "transition_time_s": self.transition.total_s if self.feasible else None,
                "score": self.score, "feasible": self.feasible, "reason": self.reason}


#: a staggered candidate's reason ends with this
STAGGERED = ", each rank updating before the commit (staggered optimizer)"

#: why units with live holders still cannot continue (Megatron's distributed optimizer, megatron_lm.distributed_optimizer)
_SHARDS_LOST = "lost their distributed-optimizer shards with every replica"


@dataclass
class ActionOption:
    """One option of a decision that is not a failure's (a slow node's, a joining node's): what the agent
    would do, and the candidate plan with its estimates and Eq. 8 score."""

    action: str
    candidate: Candidate

    def summary(self) -> dict[str, Any]:
        return {"action": self.action, **self.candidate.summary()}


def policy_label(kind: str, fill: bool, stagger: bool = False) -> str:
    """A recovery's name in tables and plots: its kind, with bubble filling and the staggered optimizer told
    apart (reroute+fill, reroute+fill+stagger, normalise+fill); shared by ``odyssey plan`` and the report view,
    which reads it from JSON."""
    if kind in ("fill", "stagger"):  # (a filled reroute's kind names its filling)
        kind, fill, stagger = "reroute", True, kind == "stagger"
    return kind + ("+fill" if fill else "") + ("+stagger" if stagger else "")


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


@dataclass
class Decision:
    policy: str
    chosen: Candidate
    candidates: list[Candidate]
    search_time_s: float
    time_to_next_failure_s: float
    global_batch: int
    failed: frozenset[int]
    cached: bool = False
    search: SearchStatus | None = None  # the exhaustive search's size and whether it finished

    @property
    def plan(self) -> ExecutionPlan | None:
        return self.chosen.plan

    @property
    def reason(self) -> str:
        return self.chosen.reason

    def to_json(self) -> dict[str, Any]:
        c = self.chosen
        step = c.step_time_s
        return {
            "policy": self.policy,
            "kind": c.kind,
            "fill": c.fill,
            "stagger": c.stagger,
            "plan": c.plan.to_dict() if c.plan else None,
            "estimates": {
                "step_time_s": _finite(step),
                "transition_time_s": c.transition.total_s,
                "throughput": self.global_batch / step if math.isfinite(step) and step > 0 else 0.0,
                "score": c.score,
                "search_s": c.transition.search_s,
                "transfer_s": c.transition.transfer_s,
                "overhead_s": c.transition.overhead_s,
                "sync_rounds": c.step.sync_rounds if c.step else None,
                "sync_lower_bound": c.step.sync_lower_bound if c.step else None,
                "transfer_bytes": c.transfers.total_bytes if c.transfers else 0,
            },
            "candidates": [x.summary() for x in self.candidates],
            "search_time_s": self.search_time_s,
            "time_to_next_failure_s": self.time_to_next_failure_s,
            "failed": sorted(self.failed),
            "reason": c.reason,
            "cached": self.cached,
            "search": self.search_json(),
        }

    def search_json(self) -> dict[str, Any]:
        """How the layouts were searched; an exhaustive search says how big it was and whether it was
        cut short by its time limit (then the plan is the best found so far)."""
        if self.search is None:
            return {"mode": "heuristic", "complete": True, "cut_short": False}
        return {"mode": "exhaustive", **self.search.to_json()}


class Planner:
    def __init__(self, profile: ModelProfile, global_batch: int, micro_batch: int,
                 options: PlannerOptions = PlannerOptions(),
                 on_search_progress: Callable[[SearchStatus], None] | None = None):
        if global_batch % micro_batch:
            raise PlanningError(f"global batch {global_batch} is not divisible by micro-batch {micro_batch}")
        self.profile = profile
        self.global_batch = global_batch
        self.num_micro_batches = global_batch // micro_batch
        self.options = options
        self.model = PipelineModel(profile)
        self.on_search_progress = on_search_progress  # the CLI's progress bar for exhaustive searches
        self.last_search: SearchStatus | None = None

    # -- entry point ------------------------------------------------------------------------------
    def decide(self, current: ExecutionPlan, new_failed: frozenset[int] | set[int],
               lost_units: frozenset[int] = frozenset(), standbys: tuple[int, ...] = ()) -> Decision:
        """Eq. 8 over every candidate for ``current`` after ``new_failed``; ``lost_units``: units whose state
        is gone although live nodes hold them (shards of Megatron's distributed optimizer whose every replica
        died): only a restart can bring them back. ``standbys``: nodes that joined and wait (they hold
        nothing): candidates that put them into the dead places, or reconfigure onto them too, are added."""
        start = time.perf_counter()
        self.last_search = None
        named = set(current.nodes())
        unknown = sorted(set(new_failed) - named)
        if unknown:
            raise PlanningError(f"failed node(s) {unknown} are not in the current plan (nodes {sorted(named)})")
        failed = frozenset(current.failed | set(new_failed))
        survivors = [n for n in current.live_nodes() if n not in failed]
        if not survivors:
            raise PlanningError("every node has failed: nothing left to plan on")
        dead_view = ExecutionPlan(current.policy, current.num_layers, current.pipelines, failed=failed)
        t_next = self.options.mtbf_hours * 3600.0 / (len(survivors) * self.options.tp)
        if lost_units:
            why = f"{_describe_units(sorted(lost_units), current.num_layers)} {_SHARDS_LOST}"
            candidates = [Candidate("reroute", None, reason=why),
                          *self._reconfigure_and_restart(dead_view, survivors, t_next, lost_units)]
        else:
            candidates = [*self._reroutes(current, failed),
                          *self._reconfigure_and_restart(dead_view, survivors, t_next),
                          *self._normalised_reroutes(dead_view),
                          *self._with_standbys(current, dead_view, failed, survivors, tuple(standbys), t_next)]
        search_s = time.perf_counter() - start
        for c in candidates:
            c.transition.search_s = search_s
            if c.feasible:
                c.restart_risk_s = self.restart_risk_of(c.plan)
                c.score = score(self.global_batch, c.step_time_s, c.transition.total_s, t_next, c.restart_risk_s)
        feasible = [c for c in candidates if c.feasible]
        if not feasible:
            reasons = "; ".join(f"{c.policy}: {c.reason}" for c in candidates)
            raise PlanningError(f"no plan can run on the {len(survivors)} surviving nodes ({reasons})")
        chosen = max(feasible, key=lambda c: (c.score, -c.step_time_s))
        return Decision(chosen.policy, chosen, candidates, search_s, t_next, self.global_batch, failed,
                        search=self.last_search)

    # -- reroute ----------------------------------------------------------------------------------
    def _reroutes(self, current: ExecutionPlan, failed: frozenset[int]) -> list[Candidate]:
        """Plain reroute (1F1B with adopted work) and, when it fits, the same routing with ReCycle's
        bubble filling; Eq. 8 chooses between them like between any two candidates."""
        plan = reroute_plan(current, failed)
        if isinstance(plan, str):
            return [Candidate("reroute", None, reason=plan)]
        out = [self._reroute_candidate(plan, f"{len(failed)} dead node(s); their micro-batches run on data-parallel "
                                             "peers (1F1B)")]
        why = (f"{len(failed)} dead node(s); their micro-batches run on data-parallel peers, weight gradients deferred "
               "into pipeline bubbles")
        out += [self._reroute_candidate(replace(plan, fill=True, stagger=stagger), why + STAGGERED * stagger)
                for stagger in self._filled_variants()]
        return out

    def _filled_variants(self) -> tuple[bool, ...]:
        """The staggered-optimizer settings a filled reroute is offered with (none without filling)."""
        if not self.options.fill:
            return ()
        return (False, True) if self.options.stagger else (False,)

    def _normalised_reroutes(self, dead_view: ExecutionPlan) -> list[Candidate]:
        """ReCycle's failure normalisation as a reconfiguration: on a uniform grid, a few live nodes move
        to the stages that lost most replicas (they fetch those layers), then the dead nodes' work is
        rerouted, plain and filled. Offered only when it moves someone and every stage keeps a replica."""
        failed = dead_view.failed
        if not self.options.normalise:
            return []
        out = normalised_grid(dead_view, failed)
        if out is None:
            return []
        moved, targets = out
        rerouted = reroute_plan(moved, failed)
        if isinstance(rerouted, str):
            return []
        transfers = schedule_transfers(dead_view.holdings(), targets, [u.state_bytes for u in self.profile.units()])
        why = (f"failure normalisation: node(s) {sorted(targets)} change stage so that the failures sit where "
               "they cost least, then the dead nodes' micro-batches run on data-parallel peers")
        # only the moved nodes build a new stage; the rest keep theirs, as in a reroute (and as the simulator
        # prices ReCycle's own normalisation: the same action costs the same in either system)
        transition = Transition(transfer_s=transfers.time_s(self.profile.transfer_bandwidth_Bps),
                                overhead_s=self.profile.reroute_overhead_s)
        variants = [(False, False)] + [(True, stagger) for stagger in self._filled_variants()]
        cands = [self._reroute_candidate(replace(rerouted, policy="reconfigure", fill=fill, stagger=stagger, reason=why),
                                         why + (", weight gradients deferred into bubbles" if fill else "")
                                         + STAGGERED * stagger, transition, transfers)
                 for fill, stagger in variants]
        return [c for c in cands if c.feasible]

    def _reroute_candidate(self, plan: ExecutionPlan, reason: str, transition: Transition | None = None,
                           transfers: TransferSchedule | None = None) -> Candidate:
        """A candidate running ``plan``'s rerouting table, under ``plan.policy`` (a normalised reroute
        moves layers first, so it is a reconfiguration); not offered when it does not fit memory."""
        step = estimate_step(plan, self.profile)
        if not step.fits_memory:
            over = step.over_memory()
            node = max(over, key=over.get)
            held = ("deferred weight gradients" + (" and the staggered optimizer's copy of the state" if plan.stagger
                                                    else "")) if plan.fill else "adopted micro-batches"
            return Candidate(plan.policy, None, reason=f"node {node} would need {over[node] / 2**30:.1f} GiB with the "
                             f"{held}, more than the device's {self.profile.device_memory_bytes / 2**30:.1f} GiB")
        return Candidate(plan.policy, plan, step, transition or Transition(overhead_s=self.profile.reroute_overhead_s),
                         transfers, reason=reason)

    def _with_standbys(self, current: ExecutionPlan, dead_view: ExecutionPlan, failed: frozenset[int],
                       survivors: list[int], standbys: tuple[int, ...], t_next: float) -> list[Candidate]:
        """Standby nodes put to work in this recovery (which rebuilds the groups anyway): in the dead places of
        the rerouted plan (fetching those stages from live twins), or in a reconfiguration onto every node."""
        if not standbys:
            return []
        from .join import fill_dead_places  # (join builds on this module)

        out = []
        unit_bytes = [u.state_bytes for u in self.profile.units()]
        rerouted = reroute_plan(current, failed)
        filled = fill_dead_places(rerouted, standbys) if not isinstance(rerouted, str) else None
        if filled is not None:
            plan, moved = filled
            transfers = schedule_transfers(dead_view.holdings(), {n: plan.holdings()[n] for n in moved.values()},
                                           unit_bytes)
            out.append(Candidate("reconfigure", plan, estimate_step(plan, self.profile), Transition(
                transfer_s=transfers.time_s(self.profile.transfer_bandwidth_Bps),
                overhead_s=self.profile.rebuild_overhead_s), transfers, tag="standby-fill",
                reason=f"standby node(s) {sorted(moved.values())} take the places of dead node(s) {sorted(moved)}"))
        shapes = self.search_layouts(len(survivors) + len(standbys), len(current.pipelines), _typical_length(current))
        best = self.best_reconfiguration(shapes, lambda shape: assign_nodes(dead_view, shape, self.profile, standbys),
                                         self.profile.rebuild_overhead_s, t_next)
        if best is not None:
            best.tag = "standby-reconfigure"
            best.reason += f" on the survivors and standby node(s) {list(standbys)}"
            out.append(best)
        return [c for c in out if c.step.fits_memory]

    # -- reconfigure / restart --------------------------------------------------------------------
    def _reconfigure_and_restart(self, current: ExecutionPlan, survivors: list[int], t_next: float,
                                 lost_units: frozenset[int] = frozenset()) -> list[Candidate]:
        shapes = self.search_layouts(len(survivors), len(current.pipelines), _typical_length(current))
        if not shapes:
            why = (f"no layout of {len(survivors)} nodes fits the model in "
                   f"{self.profile.device_memory_bytes / 2**30:.1f} GiB per device")
            return [Candidate("reconfigure", None, reason=why), Candidate("restart", None, reason=why)]
        shape = self.restart_layout(shapes, t_next)
        lost = sorted({u for u, nodes in current.holders().items() if not nodes} | set(lost_units))
        gone = _SHARDS_LOST if lost_units else "have no live copy"
        out = []
        if lost:
            out.append(Candidate("reconfigure", None, reason=f"{_describe_units(lost, current.num_layers)} {gone}"))
        else:
            best = self.best_reconfiguration(shapes, lambda shape: assign_nodes(current, shape, self.profile),
                                             self.profile.rebuild_overhead_s, t_next)
            out.append(best or Candidate("reconfigure", None, reason=f"no layout of {len(survivors)} nodes fits memory"))
        why = (f"{_describe_units(lost, current.num_layers)} {gone}: restore the last checkpoint"
               if lost else "relaunch from the last checkpoint")
        restart = replace(layout([(p.layer_split(), p.micro_batches) for p in shape.pipelines], survivors,
                                 current.num_layers, policy="restart"), reason=why)
        out.append(Candidate("restart", restart, estimate_step(restart, self.profile),
                             Transition(overhead_s=self.profile.restart_overhead_s
                                        + self.profile.checkpoint_interval_s / 2),
                             reason=why))
        return out

    def best_reconfiguration(self, shapes: list[ExecutionPlan],
                             assign: Callable[[ExecutionPlan], tuple[ExecutionPlan, TransferSchedule]],
                             overhead_s: float, t_next: float) -> Candidate | None:
        """Eq. 8 over the best few layouts, each placed on real nodes by ``assign``: a slightly slower layout
        that moves far fewer bytes, or whose next failure cannot force a restart, can win over the fastest.
        Every path that re-arranges nodes (a failure, standby nodes, joining nodes) chooses this way."""
        best = None
        for shape in shapes[: self.options.transfer_top]:
            plan, transfers = assign(shape)
            cand = Candidate("reconfigure", plan, estimate_step(plan, self.profile),
                             Transition(transfer_s=transfers.time_s(self.profile.transfer_bandwidth_Bps),
                                        overhead_s=overhead_s),
                             transfers=transfers,
                             reason=f"{len(plan.pipelines)} pipelines of lengths {[p.length for p in plan.pipelines]}")
            if not cand.step.fits_memory:
                continue
            cand.restart_risk_s = self.restart_risk_of(plan)
            cand.score = score(self.global_batch, cand.step_time_s, cand.transition.total_s, t_next,
                               cand.restart_risk_s)
            if best is None or cand.score > best.score:
                best = cand
        return best

    def restart_layout(self, shapes: list[ExecutionPlan], t_next: float) -> ExecutionPlan:
        """What a restart would run: the fastest layout, unless its own next failure would force another
        restart (one pipeline) and a safer layout among the best scores better by Eq. 8."""
        if self.restart_risk_of(shapes[0]) == 0.0:
            return shapes[0]
        return max(shapes[: self.options.transfer_top], key=lambda s: score(
            self.global_batch, estimate_step(s, self.profile).step_time_s, 0.0, t_next, self.restart_risk_of(s)))

    def restart_risk_of(self, plan: ExecutionPlan) -> float:
        if not self.options.price_restart_risk:
            return 0.0
        return restart_risk(plan, self.profile.restart_overhead_s + self.profile.checkpoint_interval_s / 2,
                            self.options.failure_bursts, self.profile.optimizer_shard_copies,
                            self.profile.tied_embeddings)

    def search_layout(self, num_nodes: int, current_dp: int, current_pp: int) -> ExecutionPlan | None:
        """Algorithm 1: the fastest layout (node ids are placeholders 0..N-1), or None if none fits."""
        layouts = self.search_layouts(num_nodes, current_dp, current_pp)
        return layouts[0] if layouts else None

    def search_layouts(self, num_nodes: int, current_dp: int, current_pp: int) -> list[ExecutionPlan]:
        """The best few layouts, fastest step first (the caller weighs their transfer costs).

        A single pipeline holds the only copy of every layer, so the next failure forces a checkpoint
        restart. With ``price_restart_risk`` Eq. 8 charges that risk, and the fastest layouts of at
        least ``min_pipelines`` pipelines are searched too (they would not be among the fastest), so
        the scoring can choose either. Without it, layouts keep at least ``min_pipelines`` pipelines
        when any such layout fits (Oobleck's f+1 rule), and only fall back to fewer when none does."""
        self.last_search = None
        if num_nodes < 1:
            return []
        floor = max(1, min(self.options.min_pipelines, num_nodes, self.num_micro_batches))
        if self.options.price_restart_risk:
            fastest = self._search_layouts(num_nodes, current_dp, current_pp, 1)
            top = self.options.transfer_top
            if floor <= 1 or any(len(s.pipelines) >= floor for s in fastest[:top]):
                return fastest
            # the fastest few are all below the floor: the best safe layouts take the last places
            seen = {s.pipelines for s in fastest}
            safe = [s for s in self._search_layouts(num_nodes, current_dp, current_pp, floor)
                    if s.pipelines not in seen][: max(1, top // 2)]
            cut = max(1, top - len(safe))
            return fastest[:cut] + safe + fastest[cut:]
        while True:
            found = self._search_layouts(num_nodes, current_dp, current_pp, floor)
            if found or floor <= 1:
                return found
            floor = 1

    def _search_layouts(self, num_nodes: int, current_dp: int, current_pp: int, floor: int) -> list[ExecutionPlan]:
        if self.options.search == "exhaustive":
            best = self._search_exhaustive(num_nodes, current_dp, current_pp, floor)
            return [best] if best else []
        return self._search_heuristic(num_nodes, current_dp, current_pp, floor)

    def _search_heuristic(self, num_nodes: int, current_dp: int, current_pp: int, floor: int) -> list[ExecutionPlan]:
        L, m_total = self.profile.num_layers, self.num_micro_batches
        cap = min(num_nodes, m_total)
        dps = [d for d in range(max(1, current_dp - self.options.dp_range), current_dp + self.options.dp_range + 1)
               if d <= cap]
        if not dps:  # many nodes lost at once: the window slid past the survivors; take the top of what fits
            dps = list(range(max(1, cap - 2 * self.options.dp_range), cap + 1))
        dps = [d for d in dps if d >= floor] or list(range(floor, min(cap, floor + 2 * self.options.dp_range) + 1))
        ranked: list[tuple[float, tuple[int, ...], list[int], list[tuple[int, ...]]]] = []
        seen: set[tuple[int, ...]] = set()

        def consider(lengths: tuple[int, ...]) -> None:
            if lengths in seen or max(lengths) > L:
                return
            seen.add(lengths)
            batch = distribute_batch(m_total, list(lengths))
            evaluated = self._evaluate(lengths, batch)
            if evaluated is not None:
                ranked.append((evaluated[0] + self._approx_sync_s(evaluated[1]), lengths, batch, evaluated[1]))

        for dp in dps:
            # lengths around the current one and around the balanced one (a lost node's pipeline may be
            # best merged into a longer one: 7 + 4 beat 6 + 5 by 1.5% on 11 nodes)
            lo = max(1, min(current_pp, num_nodes // dp) - self.options.pp_range)
            hi = min(L, max(current_pp, -(-num_nodes // dp)) + self.options.pp_range)
            if math.comb(dp + hi - lo, hi - lo) > self.options.max_multisets_per_dp:  # big: the paper's window
                lo = max(1, min(current_pp - self.options.pp_range, num_nodes // dp))
                hi = min(L, max(current_pp + self.options.pp_range, -(-num_nodes // dp)))
            for lengths in self._multisets(num_nodes, dp, lo, hi):
                consider(lengths)
        # Outside the window: with few micro-batches per pipeline, gradient sync dominates and fewer, longer
        # pipelines than the current grid win by a wide margin (the paper's +-2 window missed them by up to
        # 30%). Every other pipeline count is screened by a closed-form estimate, and the most promising few
        # are evaluated as the window's are, with balanced lengths.
        per_micro_batch_s = sum(u.forward_s + u.backward_s for u in self.profile.units())
        outside = sorted((self._screen(num_nodes, dp, m_total, per_micro_batch_s), dp)
                         for dp in range(max(1, floor), cap + 1)
                         if dp not in dps and -(-num_nodes // dp) <= L
                         and -(-num_nodes // dp) * -(-m_total // dp) <= self.options.cheap_play_slots)
        for _, dp in outside[: self.options.screen_top]:
            lo = max(1, num_nodes // dp - self.options.pp_range)
            hi = min(L, -(-num_nodes // dp) + self.options.pp_range)
            for lengths in self._multisets(num_nodes, dp, lo, hi):
                consider(lengths)
        ranked.sort(key=lambda r: r[0])
        refined: dict[str, tuple[float, ExecutionPlan]] = {}

        def keep(plan: ExecutionPlan) -> None:
            if plan.plan_id not in refined:
                refined[plan.plan_id] = (estimate_step(plan, self.profile).step_time_s, plan)

        for rank, (_, lengths, batch, splits) in enumerate(ranked[: self.options.refine_top]):
            options = [self._refine_batch(lengths, batch, splits), *self._few_pipeline_batches(lengths)]
            if len(options) > 1:  # the batch splits that look fastest by the cheap estimate
                approx = [(max(self.model.time(sp, b) for sp, b in zip(splits_k, batch_k))
                           + self._approx_sync_s(splits_k), i) for i, (batch_k, splits_k) in enumerate(options)]
                options = [options[i] for _, i in sorted(approx)[: self.options.unit_balance_batches]]
            for batch_k, splits_k in options:
                if rank < self.options.unit_balance_top:  # also with capped units per node
                    for plan in self._unit_balanced(lengths, batch_k, splits_k):
                        keep(plan)
                else:
                    keep(layout(list(zip(splits_k, batch_k)), num_layers=L))
        return [plan for _, plan in sorted(refined.values(), key=lambda x: x[0])]

    def _few_pipeline_batches(self, lengths: tuple[int, ...]) -> list[tuple[list[int], list[tuple[int, ...]]]]:
        """Every batch split of a layout with few pipelines (up to ``few_batch_splits`` of them): the
        proportional split refined one micro-batch at a time sees pipeline times only, not the sync rounds
        that different layer splits imply, and misses by a few percent there."""
        if len(lengths) > FEW_PIPELINES or max(lengths) * self.num_micro_batches > self.options.cheap_play_slots:
            return []  # many pipelines, or long plays: each batch split's layer split would cost seconds
        out, model = [], self.model.with_pipelines(len(lengths))
        for batch in islice(batch_splits(lengths, self.num_micro_batches), self.options.few_batch_splits + 1):
            splits = [split_layers(model, n, m) for n, m in zip(lengths, batch)]
            if all(s is not None for s in splits):
                out.append((batch, splits))
        return out if len(out) <= self.options.few_batch_splits else []

    def _screen(self, num_nodes: int, dp: int, m_total: int, per_micro_batch_s: float) -> float:
        """Closed-form step time of ``dp`` balanced pipelines, to pick which pipeline counts outside the
        window deserve an evaluation: a 1F1B pipeline of p even stages runs m micro-batches in about
        (m + p - 1) stage times; gradient sync takes one round per unit on the busiest node."""
        worst = 0.0
        for p in {num_nodes // dp, -(-num_nodes // dp)}:
            m = -(-m_total * p // num_nodes)
            worst = max(worst, (m + p - 1) * per_micro_batch_s / p)
        units_per_node = -(-self.profile.num_layers // (num_nodes // dp)) + 1
        return worst + units_per_node * self._sync_per_unit_s(dp)

    def _approx_sync_s(self, splits: list[tuple[int, ...]]) -> float:
        """Cheap stand-in for the colouring's sync time, to rank candidates: as many rounds as the most
        units on one node (the colouring's lower bound), each a layer's all-reduce over all pipelines."""
        return max(max_units(s) for s in splits) * self._sync_per_unit_s(len(splits))

    def _multisets(self, n: int, dp: int, lo: int, hi: int) -> list[tuple[int, ...]]:
        # C(dp + w - 1, w - 1) multisets of dp lengths from w values bound the count from above
        if math.comb(dp + hi - lo, hi - lo) <= self.options.max_multisets_per_dp:
            return list(length_multisets(n, dp, lo, hi))
        return balanced_multisets(n, dp, lo, hi)

    def _unit_balanced(self, lengths: tuple[int, ...], batch: list[int], splits: list[tuple[int, ...]]):
        """The layout as refined, plus, for each cap R on units per node, every pipeline's fastest split
        within the cap (fewer units per node = fewer sync rounds for the whole plan)."""
        L, model = self.profile.num_layers, self.model.with_pipelines(len(lengths))
        yield layout(list(zip(splits, batch)), num_layers=L)
        fronts = [split_front(model, n, m) for n, m in zip(lengths, batch)]
        for cap in sorted({max_units(s) for f in fronts for s in f}):
            chosen = []
            for front, m in zip(fronts, batch):
                within = [s for s in front if max_units(s) <= cap]
                if not within:
                    break
                chosen.append(min(within, key=lambda s, m=m: model.time(s, m)))
            else:
                yield layout(list(zip(chosen, batch)), num_layers=L)

    def _sync_per_unit_s(self, num_pipelines: int) -> float:
        """One gradient-sync round: the largest layer's all-reduce across the pipelines."""
        if num_pipelines < 2:
            return 0.0
        layer = max(self.profile.layers, key=lambda u: u.grad_bytes)
        return allreduce_time(layer.grad_bytes, num_pipelines, self.profile.allreduce_bandwidth_Bps,
                              self.profile.allreduce_latency_s)

    def _evaluate(self, lengths: tuple[int, ...], batch: list[int]) -> tuple[float, list[tuple[int, ...]]] | None:
        """Slowest pipeline time with each pipeline's best layer split; None if one cannot fit."""
        splits, worst, model = [], 0.0, self.model.with_pipelines(len(lengths))
        for length, m in zip(lengths, batch):
            split = split_layers(model, length, m)
            if split is None:
                return None
            splits.append(split)
            worst = max(worst, model.time(split, m))
        return worst, splits

    def _refine_batch(self, lengths: tuple[int, ...], batch: list[int], splits: list[tuple[int, ...]]):
        """Move micro-batches from the slowest pipeline to the one that stays fastest while the slowest
        pipeline gets faster (fixes rounding in the proportional split, and pipelines of equal length but
        unequal speed). A move takes as many micro-batches as the gap between the two pipelines' times
        suggests (:meth:`_refine_step`), halved down to one while it would not help: with hundreds of
        micro-batches per pipeline, one at a time was hundreds of layer-split searches per layout."""
        batch, splits, model = list(batch), list(splits), self.model.with_pipelines(len(lengths))
        times = [model.time(s, m) for s, m in zip(splits, batch)]
        while True:
            slow = max(range(len(batch)), key=lambda k: times[k])
            if batch[slow] <= 1:
                return batch, splits
            step = self._refine_step(lengths, batch, times, slow)
            while (move := self._refine_move(model, lengths, batch, times, slow, step)) is None:
                if step == 1:
                    return batch, splits
                step //= 2
            t, k, split, new_slow, slow_split = move
            batch[slow] -= step
            batch[k] += step
            splits[slow], splits[k] = slow_split, split
            times[slow], times[k] = new_slow, t

    @staticmethod
    def _refine_step(lengths: tuple[int, ...], batch: list[int], times: list[float], slow: int) -> int:
        """Micro-batches to move off the slowest pipeline at once: the gap to the fastest other pipeline over
        the sum of their times per micro-batch (Eq. 9: a p-stage pipeline takes T / (m + p - 1) per
        micro-batch)."""
        others = [k for k in range(len(batch)) if k != slow]
        if not others:
            return 1
        fast = min(others, key=lambda k: times[k])
        rate = sum(times[k] / (batch[k] + lengths[k] - 1) for k in (slow, fast))
        gap = int((times[slow] - times[fast]) / rate) if rate > 0 else 1
        return max(1, min(gap, batch[slow] - 1))

    def _refine_move(self, model: PipelineModel, lengths: tuple[int, ...], batch: list[int], times: list[float],
                     slow: int, step: int):
        """The pipeline that takes ``step`` micro-batches from the slowest and stays fastest, with both new layer
        splits and times, if the step's slowest pipeline is then faster than before; else None."""
        best = None
        for k in range(len(batch)):
            if k == slow:
                continue
            split = split_layers(model, lengths[k], batch[k] + step)
            if split is None:
                continue
            t = model.time(split, batch[k] + step)
            if best is None or t < best[0]:
                best = (t, k, split)
        slow_split = split_layers(model, lengths[slow], batch[slow] - step)
        if best is None or slow_split is None:
            return None
        new_slow = model.time(slow_split, batch[slow] - step)
        if max(best[0], new_slow, *(t for k, t in enumerate(times) if k not in (slow, best[1]))) >= times[slow] - 1e-12:
            return None
        return (*best, new_slow, slow_split)

    def _search_exhaustive(self, num_nodes: int, current_dp: int, current_pp: int, floor: int = 1) -> ExecutionPlan | None:
        """Every pipeline count, length multiset, batch split and Pareto-optimal layer split
        (``exhaustive.py``), started from the heuristic's best; sized and timed up front, refused past
        ``search_budget_s`` unless ``time_limit_s`` bounds it."""
        seeds = self._search_heuristic(num_nodes, current_dp, current_pp, floor)
        time_limit = self.options.time_limit_s
        if time_limit is not None and self.last_search is not None:  # second pass (lower floor): what is left
            time_limit = max(time_limit - self.last_search.elapsed_s, 1e-3)
        search = ExhaustiveSearch(self.profile, self.model, num_nodes, self.num_micro_batches, floor,
                                  seed=seeds[0] if seeds else None)
        best = search.run(time_limit, self.options.search_budget_s, self.on_search_progress)
        if self.last_search is not None:
            search.status.elapsed_s += self.last_search.elapsed_s
        search.status.time_limit_s = self.options.time_limit_s
        self.last_search = search.status
        return best


def _typical_length(plan: ExecutionPlan) -> int:
    return max(1, round(len(plan.nodes()) / len(plan.pipelines)))


def _describe_units(units: list[int], num_layers: int) -> str:
    names = []
    for u in units:
        names.append("embedding" if u == 0 else "output layer" if u == num_layers + 1 else f"layer {u - 1}")
    return ", ".join(names)


def reroute_plan(current: ExecutionPlan, failed: frozenset[int]) -> ExecutionPlan | str:
    """ReCycle-style rerouting on the current layout, or the reason it is impossible.

    Each dead node's micro-batches go one by one to the live twin (same layers) with the least work
    so far; ties go to the twin whose pipeline has adopted the least, which spreads several failures
    over different pipelines the way ReCycle's failure normalisation does."""
    pos = current.position_of()
    twins: dict[frozenset[int], list[int]] = {}
    for node, (k, i) in pos.items():
        if node not in failed:
            twins.setdefault(current.stage_units(k, i), []).append(node)
    load = {n: current.pipelines[pos[n][0]].micro_batches for n in pos if n not in failed}
    adopted_by_pipeline = [0] * len(current.pipelines)
    reroutes = []
    for node in sorted((n for n in failed if n in pos), key=lambda n: (pos[n][1], pos[n][0])):
        k, i = pos[node]
        units = current.stage_units(k, i)
        peers = twins.get(units, [])
        if not peers:
            s = current.pipelines[k].stages[i]
            return (f"stage {i} (layers {s.layers_text}) has lost every replica: "
                    "no peer can take its micro-batches")
        for j in range(current.pipelines[k].micro_batches):
            peer = min(peers, key=lambda n: (load[n], adopted_by_pipeline[pos[n][0]], n))
            load[peer] += 1
            adopted_by_pipeline[pos[peer][0]] += 1
            reroutes.append(Reroute(k, i, j, peer))
    return ExecutionPlan("reroute", current.num_layers, current.pipelines, failed=failed, reroutes=tuple(reroutes),
                         reason=f"micro-batches of dead node(s) {sorted(failed)} rerouted to data-parallel peers")
