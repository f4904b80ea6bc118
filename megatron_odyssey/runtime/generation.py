"""A rank's part in the recovery protocol, shared by both hosts that train with it.

Two hosts drive the same machinery: our standalone trainer (``odyssey train``/``demo``,
:mod:`megatron_odyssey.standalone.trainer`) and a Megatron-LM rank
(:mod:`megatron_odyssey.megatron_lm.rank`). Both follow one protocol with the agent, through
*generations* (the initial world, then one per recovery):

- **enter**: join generation ``g``'s world (a fresh prefix of the agent's store), build the plan's
  groups, build this node's stage (the host's hook), move state in (transfers from live replicas, or
  a checkpoint), and attach the pipeline executor and per-layer gradient sync;
- **step**: *ready* after gradients are synchronised, wait for the agent's *commit*, apply locally; in a
  staggered plan (``ExecutionPlan.stagger``, ReCycle's staggered optimizer) apply at once, keeping the state
  before the update until the commit, which is awaited only before the next *ready*;
- **recover**: apply a committed step, register, tear the generation down at once (so peers blocked
  on this rank fail in milliseconds), wait for the next generation's plan (a step applied ahead of a commit
  that never came is rolled back: the plan resumes at it), enter it.

What differs between the hosts is behind the hooks below (:class:`GenerationRank`'s abstract methods):
how a stage is built and what holds it, where micro-batches come from, how a committed step is
applied, how state is captured, and what must be released for the old groups to close.
"""
from __future__ import annotations

import abc
import gc
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..planning.plan import ExecutionPlan
from .config import TrainConfig
from .drop_gate import inside_key, parse_commit
from .errors import ABORTED, exit_if_stopped, fail_locally, is_peer_failure, stop_now
from .executor import PipelineExecutor
from .grad_sync import GradientSync, params_by_unit
from .op_trace import OpTrace
from .liveness import IDLE, WAITING, Progress
from .plan_message import checkpoint_due, decode_plan_message
from .transport import P2P
from .sockets import bound_silence
from .world import (RankMap, abort_all_groups, build_plan_groups, clear_parallel_state, connect_peers,
                    holds_gloo_groups, init_world, install_parallel_state, peer_pairs, shut_connections)


class Abort(RuntimeError):
    """The agent aborted this generation (a failure elsewhere)."""


def wait_key(store: dist.Store, key: str, what: str, timeout_s: float) -> bytes:
    """The value of ``key`` once set: blocks in the store (no polling); the agent answers every key a rank
    can wait on, even when it aborts, so the timeout only ends a wait whose agent is hung.

    ``get`` alone (it waits for the key itself, under the client's timeout): a ``wait`` then a ``get`` is
    one more request per rank per step for the store server, on the path from a commit to the next step
    (4096 of them at 4096 ranks: ``benchmarks/bench_coordination.py``)."""
    timeout, before = timedelta(seconds=timeout_s), store.timeout
    if timeout != before:
        store.set_timeout(timeout)
    try:
        return store.get(key)
    except dist.DistStoreError as exc:
        if "timeout" in str(exc).lower():
            raise TimeoutError(f"{what}: no answer from the agent after {timeout_s:.0f} s") from None
        raise
    finally:
        if timeout != before:
            store.set_timeout(before)


def keys(gen: int) -> dict[str, str]:
    """The store keys of generation ``gen``'s protocol (shared with the agent)."""
    g = f"odyssey/gen{gen}"
    return {"plan": f"{g}/plan", "abort": f"{g}/abort", "ready": f"{g}/ready", "commit": f"{g}/commit",
            "ops": f"{g}/ops", "recover": f"{g}/recover", "transfer": f"{g}/transfer_s", "ckpt": f"{g}/ckpt", "go": f"{g}/go"}


def node_stage(plan: ExecutionPlan, node: int) -> tuple[int, int]:
    """The layer range [start, end) ``node`` holds in ``plan``."""
    k, i = plan.position_of()[node]
    s = plan.pipelines[k].stages[i]
    return s.layer_start, s.layer_end


class GenerationRank(abc.ABC):
    """The protocol (see module docstring). A host's ``__init__`` sets ``cfg, ident, store, store_addr,
    node, tp_rank, injector, progress, device, backend, p2p`` and implements the hooks."""

    cfg: TrainConfig
    ident: int
    store: dist.Store
    store_addr: tuple[str, int]
    node: int
    tp_rank: int
    injector: Any
    progress: Progress
    device: torch.device
    backend: str
    p2p: P2P
    gen: int = 0
    committed: int = -1
    pending: int | None = None  # the step whose commit this rank waits for
    speculative: int | None = None  # a staggered plan's step applied ahead of its commit ...
    before: Any = None  # ... and the state before that update (``_capture``), until the commit
    saved: Any = None  # state captured at teardown, restored into the next generation's stage
    named: Any = ()  # (global name, parameter holding fp32 values) of the live stage
    model: Any = None
    optimizer: Any = None
    runner: Any = None
    executor: PipelineExecutor | None = None
    sync: GradientSync | None = None
    groups: Any = None
    control: Any = None  # control_plane.ControlPlane when a standby agent can take over
    trace: OpTrace | None = None  # this rank's operations per step, for the agent's diagnosis
    uses_parallel_state = True  # point megatron-core's parallel_state at each generation's groups
    tied_embeddings = False  # the output layer's weight is the word embeddings' (grad_sync, state.TIED_ALIASES)
    between_steps = False  # recovering from a failure met between two steps (Megatron-LM's loop: log, save)
    plan_message: dict | None = None  # the agent's message of the generation entered last
    # (generation, step): the agent waits for this rank to be inside that step, or a later one, to carry out a
    # drop (drop_gate); said once, at its first operation there
    say_inside: tuple[int, int] | None = None

    # -- what a host provides ----------------------------------------------------------------------
    @abc.abstractmethod
    def _build_model(self, start: int, end: int) -> None:
        """A fresh stage holding layers [start, end) on this generation's groups: sets ``model``,
        ``runner``, ``named`` and ``optimizer`` (state is restored into ``named`` afterwards)."""

    @abc.abstractmethod
    def micro_batch(self, step: int, j: int) -> dict[str, torch.Tensor]:
        """Global micro-batch ``j`` of ``step``: the same samples whichever node runs it."""

    @abc.abstractmethod
    def _apply(self, step: int) -> Any:
        """Apply the committed ``step`` locally (no collective: the commit is already agreed)."""

    def _update(self) -> None:
        """The optimizer step alone, without the commit's bookkeeping: what a staggered plan applies ahead of
        its commit. Only hosts that run staggered plans provide it (``TrainConfig.stagger``)."""
        raise NotImplementedError(f"{type(self).__name__} does not run staggered plans")

    @abc.abstractmethod
    def _capture(self) -> Any:
        """The live stage's state by global name (``state.capture``)."""

    def _complete_state(self, saved: Any) -> Any:
        """The captured state as the transfers need it (every rank holding all of its stage's state); a host
        whose capture holds only a share (Megatron's distributed optimizer) completes it here, collectively
        over the new world, before any transfer."""
        return saved

    def _rebuild_facts(self) -> dict[str, Any]:
        """What the host reports about the stage it built (the failure record shows it)."""
        return {}

    def _restore(self, state: Any) -> None:
        """Full per-parameter state (``runtime.state`` format) into the stage just built."""
        from . import state as st

        st.restore(self.named, self.optimizer, state)

    def _release(self) -> None:
        """Drop the host's objects that hold the broken generation's groups (called at teardown)."""

    def at(self, step: int, phase: str) -> None:
        """An operation boundary of ``step`` (``phase`` as in ``--fail``): progress for the agent's hang
        detection, and where injected faults fire."""
        self.progress.mark(step, phase)
        if self.say_inside is not None and phase != "recovery":
            self.entering(step)
        self.injector(step, phase)

    def entering(self, step: int) -> None:
        """This rank is inside ``step``: tell the agent if it waits for that (``drop_gate``)."""
        if self.say_inside is None or step < self.say_inside[1]:
            return
        gen, inside = self.say_inside
        self.say_inside = None
        if gen == self.gen:
            self.store.set(inside_key(gen, inside, self.ident), str(step))
            self.injector(step, "inside")

    def _heed(self, gen: int, msg: dict) -> None:
        """A plan message started while the agent waits to drop a slow node names the step to say."""
        if msg.get("say_inside") is not None:
            self.say_inside = (gen, int(msg["say_inside"]))

    def at_rest(self, step: int, phase: str) -> None:
        """A moment outside ``step``'s work (``save``, ``between``, Megatron's ``log``): not judged by progress
        (saves and logging take their time; a rank left behind the others there is: ``liveness``), and where
        injected faults fire."""
        self.progress.rest(step, phase)
        self.injector(step, phase)

    def token_count(self, step: int) -> float:
        """Loss tokens in the whole global batch of ``step`` (any rank can compute it; the executor asks
        only ranks with last-stage work, and only for per-token loss normalisation)."""
        return float(sum(self.micro_batch(step, j)["loss_mask"].sum() for j in range(self.cfg.num_micro_batches)))

    def _attach_stage(self) -> None:
        """Executor and gradient sync over the stage just built (hosts may add their own settings)."""
        self.sync = GradientSync(self.plan, self.groups, params_by_unit(self.named, self.cfg.layers),
                                 staged=self.p2p.staged, trace=self.trace, overlap=self.cfg.overlap_grad_reduce)
        self.executor = PipelineExecutor(self.plan, self.groups, self.runner, self.micro_batch,
                                         (self.cfg.seq, self.cfg.micro_batch, self.cfg.hidden),
                                         device=self.device, p2p=self.p2p,
                                         overlap=self.sync.overlapping if self.sync.overlap else None,
                                         **self.diagnosed())

    def diagnosed(self) -> dict[str, Any]:
        """The executor's settings for the diagnosis: this rank's operation record (``op_trace``; none with
        ``--slow-action off``) and fault injection's sustained slowdowns."""
        if self.trace is None and self.cfg.slow_action != "off":
            self.trace = OpTrace(self.ident, self.node)
        return {"trace": self.trace, "pace": getattr(self.injector, "pace", None),
                "slowed": getattr(self.injector, "slowed", None)}

    # -- generations -------------------------------------------------------------------------------
    def enter(self, gen: int, plan: ExecutionPlan, policy: str, transfers: list, checkpoint_step: int | None) -> None:
        from . import state as st

        cfg = self.cfg
        self.gen, self.plan, self.k = gen, plan, keys(gen)
        self.rank_map = RankMap.for_plan(plan, cfg.tp)
        if self.node not in self.rank_map.live_nodes:  # not part of this generation: nothing left to do
            raise SystemExit(0)
        rank = self.rank_map.rank(self.node, self.tp_rank)
        if gen > 0:
            self._join(gen)
        marks = [time.perf_counter()]
        init_world(self.store, gen, rank, self.rank_map.world_size, self.backend, cfg.timeout_s)
        self.progress.mark(self.progress.step, "recovery")  # each part of a rebuild is progress
        marks.append(time.perf_counter())
        self.groups = build_plan_groups(plan, self.rank_map, rank, tied=self.tied_embeddings)
        bound_silence()  # a peer whose machine goes silent fails this rank's collectives, not hangs them
        if self.backend != "gloo":  # NCCL/HCCL open pair communicators lazily: open them in one global order
            connect_peers(peer_pairs(plan, self.rank_map, transfers), rank, self.p2p, self.device)
        if self.uses_parallel_state:
            install_parallel_state(self.groups)
        marks.append(time.perf_counter())
        old = self.saved  # kept until this generation commits a step: a failure before that restarts from it
        if old is not None and policy != "restart":
            old = self._complete_state(old)
        self.progress.mark(self.progress.step, "recovery")
        self._build_model(*node_stage(plan, self.node))
        self.progress.mark(self.progress.step, "recovery")
        marks.append(time.perf_counter())
        t0 = time.perf_counter()
        if policy == "restart":
            if checkpoint_step is not None and checkpoint_step >= 0:
                self._restore(st.load_checkpoint(self._ckpt_root(), checkpoint_step, self.tp_rank, dict(self.named),
                                                 self.device))
        elif old is not None or any(dst == self.node for _, _, dst in transfers):  # (a joining rank holds nothing)
            old = old or {}
            received = st.transfer(transfers, self.node, self.tp_rank, self.rank_map.rank, cfg.layers, old,
                                   {n: p.shape for n, p in self.named}, self.device, self.p2p,
                                   aliases=st.TIED_ALIASES if self.tied_embeddings else None)
            self._restore({**old, **received})
        self.store.set(f"{self.k['transfer']}/{self.ident}", repr(time.perf_counter() - t0))
        self.store.set(f"odyssey/gen{gen}/rebuild/{self.ident}", json.dumps(
            {"world_s": marks[1] - marks[0], "groups_s": marks[2] - marks[1], "model_s": marks[3] - marks[2],
             "rank": self.ident, **self._rebuild_facts()}))
        self._attach_stage()
        self.progress.set_state(IDLE)

    def enter_admitted(self, gen: int, msg: dict) -> int:
        """A joining rank enters the generation the agent admitted it into (``runtime.joining``), receiving its
        stage's state from live replicas; returns the step to train from. A failure here makes it leave: it
        holds no state yet, and the others recover without it."""
        self.committed = int(msg["resume_step"]) - 1
        self.plan_message = msg
        self._heed(gen, msg)
        try:
            self.enter(gen, ExecutionPlan.from_dict(msg["plan"]), msg["policy"], [tuple(t) for t in msg["transfers"]],
                       msg.get("checkpoint_step"))
        except Exception as exc:
            if not is_peer_failure(exc, self.store, gen):
                fail_locally(self.store, self.ident, exc, f"joining generation {gen}")
            stop_now(self.ident, f"joining generation {gen} failed ({type(exc).__name__}: {str(exc)[:200]}); this rank "
                                 f"holds no state, so it leaves", 1)
        return int(msg["resume_step"])

    def _join(self, gen: int) -> None:
        """Wait until the agent saw every member of ``gen`` alive and joining (or aborted ``gen``), so a
        member that dies now cannot strand the others inside the process-group rendezvous."""
        self.store.set(f"odyssey/gen{gen}/join/{self.ident}", "1")
        go = keys(gen)["go"]
        self.progress.set_state(WAITING)
        if wait_key(self.store, go, f"generation {gen} never started", self.cfg.timeout_s) == ABORTED:
            self._aborted(gen)

    def _aborted(self, gen: int) -> None:
        exit_if_stopped(self.store, self.ident)  # the agent gave up: no plan will follow
        abort = keys(gen)["abort"]
        raise Abort(self.store.get(abort).decode() if self.store.check([abort]) else "aborted")

    def _ckpt_root(self) -> str:
        return os.path.join(self.cfg.workdir or ".", "checkpoints")

    # -- the commit ---------------------------------------------------------------------------------
    def _publish_ready(self, step: int, loss_share: float, tokens: float | None = None,
                       parts: list[tuple[int, float, float]] | None = None) -> None:
        """Gradients of ``step`` are synchronised here; ``loss_share`` is this rank's part of its loss (a sum
        over ``tokens`` loss tokens when given: the agent then divides the totals, as Megatron does); or
        ``parts``: each of its micro-batches' loss sum and tokens, which the agent adds up in fp32 the way
        Megatron-LM's data-parallel ranks would have (``step_loss.committed_loss``)."""
        if parts is not None:
            value = "p" + "".join(f" {j}:{n!r}:{t!r}" for j, n, t in parts)
        else:
            value = repr(loss_share) if tokens is None else f"{loss_share!r} {tokens!r}"
        summary = self.trace.summary() if self.trace is not None and self.trace.step == step else None
        if summary is not None:  # the agent reads it when it commits the step (diagnosis)
            self.store.set(f"{self.k['ops']}/{self.ident}", summary)
        # one key per step for every rank (appended atomically by the store) and one counter the agent polls:
        # the agent's commit reads two keys however many ranks there are
        self.store.append(f"{self.k['ready']}/{step}/shares", f"{self.ident}={value};")
        self.store.add(f"{self.k['ready']}/{step}/count", 1)

    def _wait_commit(self, step: int) -> float:
        """Block until the agent commits ``step`` (returns the step's loss) or aborts the generation."""
        self.progress.set_state(WAITING)
        t0 = time.perf_counter()
        value = wait_key(self.store, f"{self.k['commit']}/{step}", f"the commit of step {step}", self.cfg.timeout_s)
        if self.trace is not None:
            self.trace.commit_wait_s = time.perf_counter() - t0
        if value == ABORTED:
            self._aborted(self.gen)
        loss, inside = parse_commit(value)
        if inside is not None:
            self.say_inside = (self.gen, inside)
        return loss

    def ready_and_update(self, step: int, loss_share: float, tokens: float | None = None) -> None:
        """*Ready* for ``step``, then its update: after the agent's commit (``_apply``), or, in a staggered plan,
        at once (``_update``), the state before it kept until the commit. Every stage then updates as soon as its
        own gradients are synchronised, so a node whose deferred W's end the step late holds nobody back: its
        peers of earlier stages are already in the next step's warm-up, whose first input it waits for anyway.
        The commit guard holds: a step no commit follows is rolled back (``_resolve_ahead``)."""
        if not self.plan.stagger:
            self._publish_ready(step, loss_share, tokens)
            self._wait_commit(step)
            self.at(step, "optimizer")
            self._apply(step)
            return
        self.settle()  # the previous step's commit: answered long ago, unless the generation was aborted
        self._publish_ready(step, loss_share, tokens)
        self.at(step, "optimizer")
        self.before = self._capture()
        self.speculative, self.pending, self.saved = step, None, None
        self._update()

    def settle(self) -> None:
        """Wait for the commit of the step applied ahead of it and keep it; an aborted generation raises
        :class:`Abort` (recovery then rolls the step back)."""
        if self.speculative is not None:
            self._wait_commit(self.speculative)
            self.committed, self.speculative, self.before = self.speculative, None, None

    @property
    def held_step(self) -> int:
        """The last step whose update the live state holds (committed, or applied ahead of its commit)."""
        return self.committed if self.speculative is None else self.speculative

    def _resolve_ahead(self, resume_step: int) -> None:
        """After a failure: a step applied ahead of its commit is kept if the agent committed it (the plan
        resumes after it), else rolled back to the state before it (the plan resumes at it)."""
        if self.speculative is None:
            return
        if resume_step <= self.speculative:
            self.saved, self.committed = self.before, self.speculative - 1
            print(f"[rank {self.ident}] step {self.speculative} was updated ahead of its commit, which never came: "
                  "rolled back", file=sys.stderr, flush=True)
        else:
            self.committed = self.speculative
        self.speculative = self.before = None

    def checkpoint_due(self, step: int) -> bool:
        """Save a checkpoint after ``step`` (``plan_message.checkpoint_due``, the rule the agent expects)."""
        return checkpoint_due(step, self.cfg.checkpoint_interval, self.plan_message)

    def _committed(self, step: int) -> bool:
        key = f"{self.k['commit']}/{step}"
        return self.store.check([key]) and self.store.get(key) != ABORTED

    # -- recovery -----------------------------------------------------------------------------------
    def follow_control_plane(self) -> bool:
        """After an error: when the agent is lost and the standby took over, move this rank's store to it
        (True); the rank then recovers as from a peer failure. False when the agent is still there (on a new
        connection if the last one broke)."""
        if self.control is None:
            from .control_plane import reachable

            if not reachable(self.store):  # without a standby nothing will answer again: leave now
                stop_now(self.ident, "the agent's store is gone and this job has no standby agent")
            return False
        try:
            moved = self.control.follow(self.store)
        except ConnectionError as exc:  # the agent is gone and no standby took over: nothing will come
            stop_now(self.ident, str(exc))
        if moved is None:
            return False
        if moved.took_over:
            from .control_plane import stale_takeover

            stale = stale_takeover(moved.store, self.gen, self.committed)
            if stale is not None:
                stop_now(self.ident, stale)
        self.store, self.store_addr = moved.store, self.control.current
        self.injector.store = moved.store
        return moved.took_over

    def recover(self, step: int) -> int:
        """Leave the broken generation and join the next one; returns the step to resume at."""
        settled = False
        while True:
            try:
                self.follow_control_plane()
                if not settled:
                    if self.pending is not None and self._committed(self.pending):
                        self._apply(self.pending)  # the agent committed it before the failure: keep it
                    self.pending, settled = None, True
                # register first: the agent seals membership while we clean up (where first: it reads that after)
                if self.between_steps:
                    self.store.set(f"{self.k['recover']}/{self.ident}/between", "1")
                elif self.committed >= step:  # hit inside a step already committed: this rank goes on to its
                    # between-iterations code (Megatron-LM's training_log), which survivors hit in it run again
                    self.store.set(f"{self.k['recover']}/{self.ident}/finishing", "1")
                self.store.set(f"{self.k['recover']}/{self.ident}", str(self.held_step))
                self.teardown()
                self.at(step, "recovery")
                msg = self.plan_message = self._wait_plan(self.gen + 1)
                self._heed(self.gen + 1, msg)
                self._resolve_ahead(int(msg["resume_step"]))
                self.enter(self.gen + 1, ExecutionPlan.from_dict(msg["plan"]), msg["policy"],
                           [tuple(t) for t in msg["transfers"]], msg.get("checkpoint_step"))
                return int(msg["resume_step"])
            except Exception as exc:  # another failure while setting up: recover again, unless it is ours
                if not is_peer_failure(exc, self.store, self.gen):
                    fail_locally(self.store, self.ident, exc, f"recovery into generation {self.gen + 1}")
                abort_all_groups()

    def _wait_plan(self, gen: int) -> dict:
        """The agent's plan for generation ``gen``; exits at once if the agent gives up instead."""
        self.progress.set_state(WAITING)
        msg = decode_plan_message(wait_key(self.store, keys(gen)["plan"], f"the plan for generation {gen}",
                                           self.cfg.timeout_s))
        if "giveup" in msg:
            stop_now(self.ident, f"the agent stopped the job: {msg['giveup']}")
        return msg

    def teardown(self) -> None:
        """Close this generation's connections now, so peers blocked on this rank fail at once instead
        of waiting out a timeout: abort every group (NCCL/HCCL), shut the TCP connections (gloo, see
        ``world.shut_connections``; a GPU world's gloo groups too), capture the state, and drop every holder of a
        group."""
        abort_all_groups()
        if holds_gloo_groups(self.backend):
            shut_connections({self.store_addr[1]})
        if self.saved is None and self.model is not None:
            self.saved = self._capture()
        self._release()
        if self.sync is not None:
            self.sync.close()
        self.model = self.runner = self.executor = self.sync = self.groups = self.optimizer = None
        self.named = []
        if self.uses_parallel_state:
            clear_parallel_state()
        try:
            dist.destroy_process_group()
        except Exception:  # already torn down by a previous failure
            pass
        if self.device.type != "cpu":
            # free the old stage's device memory before the next one is built (its objects form cycles);
            # ~0.3 s with megatron loaded, so not on the CPU, where sockets are already shut (above)
            gc.collect()
