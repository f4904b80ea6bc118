"""The event loop: one policy, one seed's event stream, from t=0 to the horizon.

Between events a policy either pays a transition (throughput 0) or trains at its plan's throughput.
The engine owns what is common to every policy, so that all are charged alike:

* checkpoints every ``checkpoint_interval_s`` of training time, each stalling ``checkpoint_save_s``;
  a restart from a checkpoint throws away what was trained since the last one;
* a failure that hits a node while the job trains loses the step in flight (half a step of samples
  on average), unless the reaction already throws away everything since the last checkpoint;
* a reaction during another reaction's transition waits for it (their times add), except a restart,
  which relaunches from scratch;
* fail-slow: the cluster's true per-node slowdown is the engine's to keep (``Policy.slowdown``, which every
  policy's throughput plays), whether or not the policy notices; ``Policy.on_slow`` is its reaction. A slow
  node that is dropped is not lost work: the runtime re-plans at a step boundary.
"""
from __future__ import annotations

from .events import EventStream
from .policies.base import RESTART, START, STOP, Policy, Reaction, SimContext
from .timeline import LoggedReaction, PolicyRun, Segment


class _Run:
    def __init__(self, policy: Policy, stream: EventStream, ctx: SimContext, seed: int):
        self.policy, self.stream, self.ctx = policy, stream, ctx
        cfg = ctx.config
        self.tp = cfg.tp
        self.interval = ctx.profile.checkpoint_interval_s
        self.save_s = cfg.checkpoint_save_s
        self.step_samples = ctx.cost.samples_per_step
        self.out = PolicyRun(policy.name, seed, stream.horizon_s)
        self.alive: set[int] = set(stream.initial)
        self.slow: dict[int, float] = {}  # live nodes' slowdown factors (> 1)
        self.t = 0.0
        self.busy_until = 0.0
        self.busy_state = START
        self.rate = 0.0  # samples/s once the transition is over
        self.ckpt_phase = 0.0  # training seconds since the last checkpoint
        self.since_ckpt = 0.0  # samples trained since the last checkpoint
        self.since_event = 0.0  # samples trained since the last reaction (bounds a lost partial step)
        self.started = False

    # -- time ----------------------------------------------------------------------------------------
    def _record(self, t0: float, t1: float, rate: float, state: str) -> None:
        used = len(self.policy.nodes_in_use()) * self.tp if self.policy.running else 0
        self.out.add_segment(Segment(t0, t1, rate, state, len(self.alive) * self.tp, used))

    def advance(self, t1: float) -> None:
        while self.t < t1:
            t = self.t
            if not self.policy.running:
                self._record(t, t1, 0.0, "stopped" if self.started else "waiting")
                self.t = t1
            elif self.busy_until > t:
                end = min(self.busy_until, t1)
                self._record(t, end, 0.0, self.busy_state)
                self.t = end
            elif self.rate <= 0:
                self._record(t, t1, 0.0, "stalled")
                self.t = t1
            else:
                end = min(t1, t + self.interval - self.ckpt_phase)
                gained = self.rate * (end - t)
                self._record(t, end, self.rate, "training")
                self.out.trained_samples += gained
                self.since_ckpt += gained
                self.since_event += gained
                self.ckpt_phase += end - t
                self.t = end
                if self.ckpt_phase >= self.interval * (1 - 1e-12):
                    self.ckpt_phase, self.since_ckpt = 0.0, 0.0
                    if self.save_s > 0:
                        self.busy_until, self.busy_state = end + self.save_s, "checkpoint"

    # -- reactions -----------------------------------------------------------------------------------
    def apply(self, r: Reaction | None, failure_hit: bool = False) -> None:
        if r is None:
            return
        if r.kind == "none":
            return
        lost = 0.0
        if r.lose_since_checkpoint:
            lost = self.since_ckpt
        elif failure_hit and self.ctx.config.lose_partial_step and self.busy_until <= self.t:
            lost = min(0.5 * self.step_samples, self.since_event)
        self.out.lost_samples += lost
        self.since_ckpt = max(0.0, self.since_ckpt - lost)
        if r.lose_since_checkpoint or r.saves_checkpoint or r.kind == RESTART:
            self.since_ckpt, self.ckpt_phase = 0.0, 0.0
        if r.kind in (RESTART, START, STOP):
            self.busy_until = self.t + r.transition_s
        else:
            self.busy_until = max(self.busy_until, self.t) + r.transition_s
        self.busy_state = r.kind
        self.since_event = 0.0
        if r.kind in (START, RESTART):
            self.started = True
        self.out.reactions.append(LoggedReaction(self.t, r.kind, r.transition_s, lost, r.note))

    def _update_slowdown(self, ev) -> None:
        """The nodes' true speeds after ``ev`` (dead nodes are not slow), told to the policy first: its
        throughput from now on plays them, whatever it decides to do about them."""
        for n in ev.removed:
            self.slow.pop(n, None)
        for n, f in ev.slowdown:
            if f > 1.0:
                self.slow[n] = f
            else:
                self.slow.pop(n, None)
        self.policy.slowdown = dict(self.slow)

    def run(self) -> PolicyRun:
        p = self.policy
        self.apply(p.start(frozenset(self.alive), len(self.alive) >= self.ctx.job_nodes))
        self.rate = p.throughput()
        for ev in self.stream.events:
            self.advance(ev.time_s)
            self.alive -= ev.removed
            self.alive |= ev.added
            alive = frozenset(self.alive)
            self._update_slowdown(ev)
            if p.running:
                hit = bool(ev.removed & p.nodes_in_use())
                if ev.removed:
                    self.apply(p.on_failure(ev.removed, alive), failure_hit=hit)
                if ev.added and p.running:
                    self.apply(p.on_add(ev.added, alive))
                elif ev.added:
                    self.apply(p.start(alive, False))
                if ev.slowdown and p.running:
                    self.apply(p.on_slow(dict(self.slow), alive))
            elif ev.added:
                self.apply(p.start(alive, False))
            self.rate = p.throughput()
        self.advance(self.stream.horizon_s)
        return self.out


def simulate_policy(policy: Policy, stream: EventStream, ctx: SimContext, seed: int = 0) -> PolicyRun:
    """Run ``policy`` over ``stream`` and return its timeline."""
    return _Run(policy, stream, ctx, seed).run()
