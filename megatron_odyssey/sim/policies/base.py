"""What a policy is to the engine: a plan-keeping object that reacts to cluster changes.

The engine owns time, checkpoints and accounting; a policy owns its plan and answers four
questions: can I start on these nodes, what do I do when nodes I use die, what do I do when nodes
join, what do I do when nodes get slow or recover (fail-slow; by default nothing: ReCycle, Oobleck
and checkpoint-restart do not detect fail-slow, so their steps just get slower). Each answer is a
:class:`Reaction`: how long training stops and whether progress since the last checkpoint is lost.
The policy's throughput afterwards is read from :meth:`Policy.throughput`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any

from ...planning.fit import Grid, explain_misfit, suggest_layout
from ...planning.plan import ExecutionPlan
from ...planning.planner import Planner, PlannerOptions
from ...planning.profile import ModelProfile
from ..config import SimulationConfig
from ..costmodel import CostModel
from ..errors import SimulationError

NONE, START, REROUTE, RECONFIGURE, FILL, RESTART, STOP, REBALANCE = (
    "none", "start", "reroute", "reconfigure", "fill", "restart", "stop", "rebalance")


@dataclass(frozen=True)
class Reaction:
    kind: str = NONE
    transition_s: float = 0.0
    lose_since_checkpoint: bool = False  # restart from the last checkpoint: later progress is lost
    saves_checkpoint: bool = False  # progress is saved first (orderly stop, voluntary restart)
    note: str = ""

    @property
    def changes_plan(self) -> bool:
        return self.kind not in (NONE, STOP)


KEEP = Reaction()


def then(first: Reaction, second: Reaction) -> Reaction:
    """Two reactions at one instant (a failure, then using spare nodes): times add up."""
    if second.kind == NONE:
        return first
    if first.kind == NONE:
        return second
    kind = RESTART if RESTART in (first.kind, second.kind) else second.kind
    return Reaction(kind, first.transition_s + second.transition_s,
                    first.lose_since_checkpoint or second.lose_since_checkpoint,
                    first.saves_checkpoint or second.saves_checkpoint,
                    "; ".join(x for x in (first.note, second.note) if x))


@dataclass
class SimContext:
    """Everything shared by the policies of one run (and across its seeds, so memos pay off)."""

    config: SimulationConfig
    profile: ModelProfile
    cost: CostModel
    mtbf_hours: float
    failure_bursts: tuple[tuple[int, float], ...] = ((1, 1.0),)  # nodes per failure event (Eq. 8's restart risk)
    memo: dict[str, dict[Any, Any]] = field(default_factory=dict)
    _planners: dict[tuple, Planner] = field(default_factory=dict)

    @classmethod
    def build(cls, config: SimulationConfig, base_profile: ModelProfile, mtbf_hours: float,
              failure_bursts: tuple[tuple[int, float], ...] = ((1, 1.0),)) -> "SimContext":
        ckpt = config.checkpoint_interval_s or base_profile.checkpoint_interval_s
        profile = replace(
            base_profile,
            reroute_overhead_s=base_profile.reroute_overhead_s if config.reroute_overhead_s is None else config.reroute_overhead_s,
            rebuild_overhead_s=base_profile.rebuild_overhead_s if config.rebuild_overhead_s is None else config.rebuild_overhead_s,
            restart_overhead_s=config.relaunch_s + config.checkpoint_load_s,
            checkpoint_interval_s=ckpt)
        cost = CostModel(profile, config.num_micro_batches, config.micro_batch)
        ctx = cls(config, profile, cost, mtbf_hours, failure_bursts)
        if ctx.initial_plan(list(range(config.num_nodes))) is None:
            raise SimulationError(misfit_message(config, profile))
        return ctx

    # -- shared knobs ------------------------------------------------------------------------------
    @property
    def job_nodes(self) -> int:
        return self.config.num_nodes

    @property
    def restart_s(self) -> float:
        return self.config.relaunch_s + self.config.checkpoint_load_s

    @property
    def voluntary_restart_s(self) -> float:
        """Save now, relaunch, load: a restart that loses nothing."""
        return self.config.checkpoint_save_s + self.restart_s

    @property
    def planner(self) -> Planner:
        return self.planner_with()

    def planner_with(self, **options: Any) -> Planner:
        """The planner with the run's search, MTBF and TP and these other options (one per option set)."""
        key = tuple(sorted(options.items()))
        if key not in self._planners:
            self._planners[key] = Planner(self.profile, self.config.global_batch, self.config.micro_batch,
                                          PlannerOptions(search=self.config.search, mtbf_hours=self.mtbf_hours,
                                                         tp=self.config.tp, failure_bursts=self.failure_bursts,
                                                         **options))
        return self._planners[key]

    def time_to_next_failure_s(self, nodes: int) -> float:
        """Eq. 8's horizon: per-device MTBF over the devices in use."""
        return self.mtbf_hours * 3600.0 / max(1, nodes * self.config.tp)

    def worth_growing(self, current_throughput: float, new_throughput: float, transition_s: float,
                      nodes: int) -> bool:
        """Growth rule for the baselines' voluntary restarts onto joining nodes: do it only if it pays
        back before the expected next failure (Eq. 8 applied to "restart bigger" vs "carry on"), so a
        stream of single-node additions does not cause a stream of restarts."""
        t_next = self.time_to_next_failure_s(nodes)
        return new_throughput * max(t_next - transition_s, 0.0) / t_next > current_throughput * (1 + 1e-9)

    def initial_plan(self, nodes: list[int]) -> ExecutionPlan | None:
        """The job as launched: Megatron's PP x DP grid on ``nodes`` (same for every policy)."""
        c = self.config
        plan = self.cost.symmetric(c.pp, c.dp, nodes, policy="initial")
        if plan is None or not self.cost.estimate(plan).fits_memory:
            return None
        return plan

    def memo_of(self, name: str) -> dict[Any, Any]:
        return self.memo.setdefault(name, {})


def misfit_message(config: SimulationConfig, profile: ModelProfile) -> str:
    """The launch grid does not fit memory: say by how much and which grid would (the memory estimator
    over TP 1-8 for a built-in model; a profile file is fixed at its own TP)."""
    from ..profiles import resolve_model

    def profile_for_tp(tp: int) -> ModelProfile | None:
        if config.profile is not None:
            return profile if tp == config.tp else None
        return resolve_model(config.model, config.num_layers, tp, config.micro_batch, config.seq_length)

    grid = Grid(config.tp, config.pp, config.dp)
    suggestion = suggest_layout(profile_for_tp, config.npus, config.num_micro_batches, config.dp)
    label = config.profile or config.model
    return explain_misfit(profile, grid, config.num_micro_batches, suggestion, "--npus", lambda g: g.devices, label)


class Policy(ABC):
    """A fault-tolerance policy. Subclasses keep their plan and react to cluster changes."""

    name = "policy"

    def __init__(self, ctx: SimContext):
        self.ctx = ctx
        self.cost = ctx.cost
        self.slowdown: dict[int, float] = {}  # the cluster's true slow nodes (set by the engine); throughput plays them
        self.benched: set[int] = set()  # live nodes the policy knows are slow and will not use until they recover

    # -- state the engine reads --------------------------------------------------------------------
    @abstractmethod
    def throughput(self) -> float:
        """Samples per second once the current transition is over (0 while stopped)."""

    @abstractmethod
    def nodes_in_use(self) -> frozenset[int]:
        """Live nodes doing work for the job."""

    @property
    @abstractmethod
    def running(self) -> bool:
        """True once started and not stopped."""

    # -- reactions ---------------------------------------------------------------------------------
    @abstractmethod
    def start(self, alive: frozenset[int], full_launch: bool) -> Reaction | None:
        """Start (or restart after a stop) on ``alive`` nodes, or None if they are not enough.
        ``full_launch``: the cluster is complete at t=0, so the job runs its configured grid."""

    @abstractmethod
    def on_failure(self, removed: frozenset[int], alive: frozenset[int]) -> Reaction:
        """``removed`` nodes left (some may be unused); ``alive`` is the cluster afterwards."""

    @abstractmethod
    def on_add(self, added: frozenset[int], alive: frozenset[int]) -> Reaction:
        """``added`` nodes joined; ``alive`` is the cluster afterwards."""

    def on_slow(self, slow: dict[int, float], alive: frozenset[int]) -> Reaction:
        """Nodes got slow or recovered; ``slow`` is every live node's slowdown factor (> 1) now. By default
        the policy does not notice (no fail-slow detection): it carries on and ``throughput`` gets slower."""
        return KEEP

    # -- helpers -----------------------------------------------------------------------------------
    def spare(self, alive: frozenset[int]) -> list[int]:
        """Live nodes the job could still take (not benched as slow), lowest ids first, up to the job's size."""
        used = self.nodes_in_use()
        room = self.ctx.job_nodes - len(used)
        return sorted(alive - used - self.benched)[:max(0, room)]

    def pick(self, alive: frozenset[int]) -> list[int]:
        return sorted(alive - self.benched)[: self.ctx.job_nodes]
