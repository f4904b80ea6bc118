"""One rank of a Megatron-LM ``pretrain_gpt.py`` job under Odyssey: Megatron's own model, optimizer,
scheduler, dataset and forward step, driven through generations by the protocol both hosts share
(:class:`~megatron_odyssey.runtime.generation.GenerationRank`).

Generation 0 is Megatron's own job, untouched: its world and uniform grid, its schedule and its DDP
gradient reduction run as they would without Odyssey (stock speed), and only ``optimizer.step`` is
guarded: Megatron's own gradient norm is computed and the agent's *commit* awaited before Megatron's
step runs, so no rank applies an update the others may not. After the first failure the hand-off is
one-way: Odyssey's executor, per-layer gradient sync and plan-wide norm run every later generation
(executor -> per-layer gradient sync -> plan-wide norm -> *ready* -> *commit* -> optimizer). The rank
joins the next generation's world through the agent's store, points ``parallel_state`` at the new
plan's groups, rebuilds its stage with Megatron's ``get_model`` (the captured model provider, with
the stage's layer range) and ``get_megatron_optimizer`` (the captured arguments), moves state in by
global parameter name, and swaps the result *into* the objects ``train()`` holds (the model list is
updated in place, the optimizer object takes the new one's state), so Megatron's loop, logging and
scheduler carry on unaware.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..arguments import parse_rejoin
from ..planning.cluster import node_ranks
from ..planning.plan import ExecutionPlan
from ..runtime.config import TrainConfig
from ..runtime.control_plane import client
from ..runtime.sockets import bound_silence
from ..runtime.executor import PipelineExecutor
from ..runtime.grad_sync import GradientSync, all_reduce_flat, params_by_unit, unit_of
from ..runtime.device_profile import REPLICA_COPIES
from ..runtime.drop_gate import parse_commit
from .distributed_optimizer import (ShardedState, capture_pieces, deferred_param_sync, distributed_optimizers,
                                    reassemble, stage_holder_groups, unit_holder_groups)
from .batch_ramp import BatchRamp, megatron_batch_ramp
from .replica_optimizer import ReplicaShards
from . import log_writers, loss_scale, rerun
from .rerun import RerunExit
from .samples import GlobalMicroBatches
from .checkpoint import unrecorded_optimizer_format
from .versions import installed_version
from .hooks import ORIGINAL_ATTR, STATE, loss_reduction_as_communication, overridden, sub_optimizers
from .interleaved import InterleavedCapture, chunk_layer_start, reshuffle_transfers, shapes_for_layers
from .plan_norms import plan_grad_norm, plan_params_norm, plan_zero_count, unit_owners
from .views import TIED_NAMES, MegatronStageRunner, OptimizerStateView, megatron_global_names
from ..runtime.errors import (GIVEUP_KEY, STARTED_KEY, ErrorRecord, dump_stacks_on_signals, fail_locally,
                              giveup_reason, is_failure_abort, is_peer_failure, leave_with, stop_now)
from ..runtime.generation import GenerationRank, keys, node_stage
from ..runtime.liveness import Heartbeat, Progress, StoreThread, communicating, track
from ..runtime.transport import P2P
from ..runtime.state import TIED_ALIASES
from ..runtime.world import RankMap, abort_all_groups, holds_gloo_groups, plan_process_groups, shut_connections
from ..runtime.stuck_call import StuckCall

STORE_ENV = "ODYSSEY_STORE"  # HOST:PORT of the agent's store, set by the launcher
WORKDIR_ENV = "ODYSSEY_WORKDIR"


class OdysseyRestart(SystemExit):
    """The agent resumed at an iteration this rank cannot reach in-process: the job must be relaunched."""


class AbortWatcher(StoreThread):
    """Aborts this rank's groups as soon as the agent aborts the generation. A rank blocked inside a
    collective never polls the store, and NCCL/HCCL do not see a dead peer's closed connection the way
    gloo does (they would wait for the watchdog timeout); aborting from here unblocks the op at once.
    Gloo's groups close nothing when aborted: for an abort because ranks failed, this rank's connections are
    shut too (``world.shut_connections``, as its teardown does; in a GPU job as well where it holds gloo groups,
    which Megatron makes beside the NCCL/HCCL ones), since a failed rank the agent could not reach to
    kill (cut off from the agent's machine, not from this one) may live on and hold a collective open with it.
    A main thread still inside the same torch.distributed call ``stuck_after_s`` after that shut is in a wait gloo
    never ends (``runtime.stuck_call``): the rank then leaves, with a record that says so, and the job recovers
    without it at once rather than fencing it at the hard timeout.
    When the agent gives up on the job (or stays unreachable), it ends the process at once: nothing will
    come. A store hiccup is retried (``StoreThread``), not taken for the end of the job."""

    what = "abort watcher"

    def __init__(self, runtime: "MegatronRank", host: str, port: int, interval_s: float = 0.05, control: Any = None,
                 stuck_after_s: float = 10.0, **kw: Any):
        super().__init__(host, port, runtime.ident, interval_s, control=control, **kw)  # (follows a takeover)
        self.runtime, self.handled = runtime, -1
        self.stuck_after_s = stuck_after_s
        self.shut: tuple[int, str, StuckCall] | None = None  # (generation, its abort, the watch) after a shut

    def tick(self, store: Any) -> None:
        gen = self.runtime.gen
        aborted = gen != self.handled and store.check([f"odyssey/gen{gen}/abort"])
        if store.check([GIVEUP_KEY]):
            stop_now(self.runtime.ident, f"the agent stopped the job: {giveup_reason(store) or 'no reason given'}")
        if aborted:
            value = store.get(f"odyssey/gen{gen}/abort").decode(errors="replace")
            failed = is_failure_abort(value)
            with self.runtime.gen_lock:
                if self.runtime.gen == gen:
                    try:
                        abort_all_groups()
                    except Exception:  # the main thread is tearing the same groups down
                        pass
                    if failed and holds_gloo_groups(self.runtime.backend):
                        shut_connections({self.runtime.store_addr[1]})
                        self.shut = (gen, value, StuckCall(self.stuck_after_s))
            self.handled = gen
        self._leave_if_stuck(store)

    def _leave_if_stuck(self, store: Any) -> None:
        if self.shut is None:
            return
        gen, abort, watch = self.shut
        if self.runtime.gen != gen:  # the main thread left the call and recovers
            self.shut = None
            return
        frame = watch.stuck()
        if frame is None:
            return
        why = (f"the main thread is still inside {watch.place(frame)} {watch.waited_s():.0f} s after the abort "
               f"({abort}) shut every connection of its gloo groups: gloo never wakes an operation whose message "
               f"was in flight when its connection closed (runtime.stuck_call); it waits out its group's timeout "
               f"(--distributed-timeout-minutes in Megatron's own groups). Nothing in-process ends that wait: leaving "
               f"the job, so that it recovers without this rank now rather than fencing it at --odyssey-hard-timeout")
        progress = getattr(self.runtime, "progress", None)
        record = ErrorRecord.stuck(self.runtime.ident, f"step {progress.step}" if progress is not None and
                                   progress.step >= 0 else "training", why, frame)
        print(f"[odyssey rank {self.runtime.ident}] {record.where}: {why}\n{record.traceback}", file=sys.stderr,
              flush=True)
        leave_with(store, self.runtime.ident, record)

    def lost(self, exc: BaseException) -> None:
        stop_now(self.runtime.ident, f"the agent is gone ({type(exc).__name__}: {str(exc)[:120]})")


def stack_dump_signal(args: Any) -> int:
    """SIGUSR1 asks a rank for its stacks, unless the job reads it as Megatron's exit signal (``--exit-signal 10``,
    what a scheduler's early warning such as SLURM's ``--signal=USR1@120`` sends): registering faulthandler on it
    would take the signal from Megatron's handler, and the job would not save before its end. SIGUSR2 then."""
    exit_signal = int(getattr(args, "exit_signal", signal.SIGTERM) or signal.SIGTERM)
    return int(signal.SIGUSR2 if exit_signal == signal.SIGUSR1 else signal.SIGUSR1)


def launch_layer_split(model: list, pp: int, layers: int) -> list[int] | None:
    """Megatron's own split of the layers over the pipeline stages in generation 0, where it is not the uniform
    one (``--decoder-first/last-pipeline-num-layers``, ``--account-for-*-in-pipeline-split``,
    ``--pipeline-model-parallel-layout``): read off every rank's built chunks (one gather over the launch world, at
    start-up), so each release's own rules decide it. None where uniform."""
    from megatron.core import parallel_state

    from ..planning.plan import even_split
    from .interleaved import chunk_layer_count

    mine = (parallel_state.get_pipeline_model_parallel_rank(), sum(chunk_layer_count(c) for c in model))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    split = [dict(everyone)[stage] for stage in range(pp)]
    if tuple(split) == even_split(layers, pp):
        return None
    if len(model) > 1:
        raise ValueError(f"--odyssey runs interleaved pipelines with Megatron's uniform split only; this job's "
                         f"stages hold {split} of the {layers} layers (leave out the options that make it uneven, or "
                         f"--num-layers-per-virtual-pipeline-stage)")
    if min(split) < 1:
        raise ValueError(f"--odyssey needs at least one transformer layer on every pipeline stage; this job's stages "
                         f"hold {split} of the {layers} layers")
    return split


def config_from_megatron_args(args: Any) -> TrainConfig:
    """The planner's view of a Megatron job (what the agent needs to plan and to report)."""
    from ..runtime.device_profile import megatron_job_fields

    ramp = megatron_batch_ramp(args)
    version = installed_version()
    return TrainConfig(
        nproc=args.world_size, tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
        layers=args.num_layers, hidden=args.hidden_size, heads=args.num_attention_heads, seq=args.seq_length,
        global_batch=ramp.global_batch if ramp else args.global_batch_size, micro_batch=args.micro_batch_size,
        steps=args.train_iters,
        seed=args.seed, ffn_hidden=args.ffn_hidden_size, vocab=getattr(args, "padded_vocab_size", None) or 32000,
        lr=args.lr, report=args.odyssey_report, backend=args.distributed_backend,
        timeout_s=max(120.0, 4 * args.odyssey_heartbeat_timeout, 2 * args.odyssey_hard_timeout), fail=list(args.odyssey_inject_fault),
        policy=args.odyssey_policy, slow_action=getattr(args, "odyssey_slow_action", "auto"), heartbeat_interval_s=min(1.0, args.odyssey_heartbeat_timeout / 10),
        heartbeat_timeout_s=args.odyssey_heartbeat_timeout, checkpoint_interval=0,
        stack_dump_signal=stack_dump_signal(args),
        stagger=False,  # Megatron's update clips by the plan-wide norm: every stage's gradients first
        overlap_grad_reduce=bool(getattr(args, "overlap_grad_reduce", False)),
        soft_timeout_s=args.odyssey_soft_timeout, hard_timeout_s=args.odyssey_hard_timeout,
        first_step_timeout_s=args.odyssey_first_step_timeout,
        workdir=os.environ.get(WORKDIR_ENV), mtbf_hours=args.odyssey_mtbf_hours,
        extra={"megatron": True, "start_step": int(args.iteration),
               "exit_interval": getattr(args, "exit_interval", None) or None, "save_dir": getattr(args, "save", None),
               "optimizer_format": unrecorded_optimizer_format(args, version),
               "tied_embeddings": not getattr(args, "untie_embeddings_and_output_weights", True),
               # how the logged loss is added up (step_loss.committed_loss)
               "loss_reduced_per_micro_batch": bool(version and version.loss_reduced_per_micro_batch),
               **({"batch_ramp": ramp.to_list()} if ramp else {}),
               **({"step_batch_size_schedule": args.step_batch_size_schedule}
                  if getattr(args, "step_batch_size_schedule", None) else {}),
               "max_cached_failures": args.odyssey_max_cached_failures,
               "profile_iters": args.odyssey_profile_iters, **megatron_job_fields(args),
               **({"rejoin": parse_rejoin(args.odyssey_rejoin, "--odyssey-rejoin")}
                  if getattr(args, "odyssey_rejoin", None) else {})})


# -- the rank --------------------------------------------------------------------------------------------

class MegatronRank(GenerationRank):
    """The shared protocol over the objects Megatron's ``train()`` holds (see module docstring)."""

    started = False  # set once the first iteration begins (start-up failures end the job instead)
    shards: ReplicaShards | None = None  # a rebuilt stage's sharded optimizer state (replica_optimizer)

    def __init__(self, args: Any, model: list, optimizer: Any, scheduler: Any, joining: bool = False):
        """``joining``: a rank of a machine that comes back (megatron_lm.joining), set up in a private world; it
        holds no state and runs no generation until :meth:`await_admission` and its first iteration."""
        from ..runtime.faults import Injector
        from .joining import job_config, join_rank

        host, port = os.environ[STORE_ENV].rsplit(":", 1)
        cfg = job_config() if joining else config_from_megatron_args(args)
        dump_stacks_on_signals(cfg.stack_dump_signal)
        store = client((host, int(port)), cfg.timeout_s)
        bound_silence()  # Megatron's gloo groups too: a peer whose machine goes silent fails a collective, not hangs it
        ident = join_rank() if joining else dist.get_rank()
        self.cfg, self.ident, self.store, self.store_addr = cfg, ident, store, (host, int(port))
        self.args, self.megatron_model, self.megatron_optimizer, self.scheduler = args, model, optimizer, scheduler
        self.node, self.tp_rank = divmod(self.ident, cfg.tp)
        self.tied_embeddings = bool(cfg.extra.get("tied_embeddings", False))
        self.batch_ramp = BatchRamp.from_list(cfg.extra.get("batch_ramp"))  # a growing global batch (batch_ramp)
        self.injector = Injector(cfg.fail_specs(), self.ident, store)
        self.progress = Progress()
        track(self.progress)  # marked by the executor and gradient sync around communication (liveness)
        self.device = next(model[0].parameters()).device
        from ..runtime.accelerator import rank_backend

        # the survivors' worlds: gloo where Megatron's world is gloo's (ranks sharing one GPU too), else the device's
        # (read from the world, not Megatron's flag: it says "nccl" on Ascend too, whose world is HCCL's)
        self.backend = rank_backend(shared=dist.get_backend() == "gloo", device_type=self.device.type)
        self.p2p = P2P.for_backend(self.backend, self.device)
        self.stock = not joining  # generation 0: Megatron's own schedule and DDP (see module docstring)
        self.joined_the_running_job = joining  # its train() starts mid-job (between_steps.training_log)
        self.loading_checkpoint = False  # inside an in-process restart's load_checkpoint
        self.admission: tuple[int, dict] | None = None  # a joining rank's generation and plan, until it enters
        self.current_step = int(args.iteration)
        self.timed_iterations = 0  # iterations timed on odyssey-forward-backward (profile window)
        self.committed, self.pending, self.saved = int(args.iteration) - 1, None, None
        self.pending_norm: float | None = 0.0  # None: the step overflowed (--fp16) and is skipped
        self.pending_zeros: float | None = None  # its gradient's zero count, where the release logs one
        version = installed_version()
        self.counts_zeros = bool(version and version.counts_zeros_every_step) and \
            type(optimizer).__name__ == "ChainedOptimizer"
        self.pending_overflow = False
        self.scheduled_before: int | None = None  # the schedule's step count at a stock step's commit, until it is through
        self.scaler_updates: list[Callable[[], None]] = []  # generation 0's loss-scaler updates, applied with the step
        self.scaler_state: list[dict[str, Any]] | None = None  # the loss scalers across a rebuild (loss_scale)
        self.samples: GlobalMicroBatches | None = None  # which samples a global micro-batch holds
        self.eval_samples: dict[str, GlobalMicroBatches] = {}  # ... of the evaluation splits (run_evaluation)
        if STATE.captured.train_ds is not None:  # now: a --dataloader-type it cannot follow fails the start
            self._global_micro_batches()
        # --odyssey-profile-iters: time iterations [first, end) with Megatron's timers (the first one
        # after start-up is a warm-up), then publish this stage's per-layer costs to the agent (past a batch-size
        # ramp: the profile is of the final global batch, which every plan splits)
        first = max(int(args.iteration) + 1, self.batch_ramp.ramp_end + 1 if self.batch_ramp else 0)
        self.profile_window = range(first, first + (0 if joining else int(args.odyssey_profile_iters)))
        self.timing = False
        self.last_result: Any = None
        self.arity = 8 if "log_max_attention_logit" in inspect.getsource(_original_train_step()) else 7
        if self.ident == 0 and not joining:  # the planner's device: its memory and matmul rate in the job's dtype
            from ..runtime.device_profile import measure_device

            cfg.extra["device"] = measure_device(self.device, _activation_dtype(args))
        store.set(f"odyssey/device/{self.ident}", f"{self.device} ({self.backend})")  # for the report
        if not joining:
            cfg.layer_split = launch_layer_split(model, cfg.pp, cfg.layers)
        if self.ident == 0 and not joining:
            from ..runtime.joining import CONFIG_KEY

            store.set(CONFIG_KEY, json.dumps(cfg.__dict__))
        self.gen_lock = threading.RLock()  # held while this thread aborts, tears down or builds groups
        plan = self.gen0_plan = cfg.launch_plan()
        self.gen0_vpp = int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1)
        self.keyed_dropout = bool(getattr(args, "hidden_dropout", 0) or getattr(args, "attention_dropout", 0))
        if joining:
            self._adopt_private_world()
        else:
            self._adopt_generation0(plan)
            log_writers.follow_the_last_rank(args, store)  # the launch's last rank publishes its W&B run
        from ..runtime.op_trace import ComputeTimer

        # generation 0's compute, timed in Megatron's own schedule for the diagnosis (the forward step in
        # _injecting, the backward in hooks.timed_backward_step) and slowed there by an injected slowdown
        self.stock_timer = ComputeTimer.for_device(self.device, **self.diagnosed())
        from .stock_trace import StockMessages  # ... and its messages (hooks.traced_p2p)

        self.stock_messages = StockMessages(self.node, cfg.pp, cfg.dp, self.stock_timer)
        from ..runtime.control_plane import ControlPlane, judged_lost_after

        self.control = ControlPlane.from_env(self.store_addr, self.ident, store, cfg.timeout_s,
                                             judged_lost_after(cfg.heartbeat_timeout_s),
                                             joined_pid=os.getpid() if joining else None)
        if self.control.standby is None:
            self.control = None
        else:
            self.control.ready()  # (this main thread's client of the standby's store, for a takeover)
        if not joining:  # (a joining rank beats once it asks to join: its rank's earlier life may still be beating)
            self._start_heartbeat()
        AbortWatcher(self, host, int(port), control=self.control,
                     stuck_after_s=min(10.0, self.cfg.heartbeat_timeout_s)).start()
        import atexit

        atexit.register(self._say_done_at_exit)  # (again: clean_exit says it first, before the teardown)

    def _start_heartbeat(self) -> None:
        Heartbeat(*self.store_addr, self.ident, self.cfg.heartbeat_interval_s, self.progress, self.control).start()

    def say_done(self) -> None:
        """At a clean end: tell the agent (a standby cannot see this process's exit code once its launcher
        is gone, see control_plane.OrphanRank; and a rank blocked tearing down its groups is not hung, see
        clean_exit.say_done)."""
        from ..runtime.control_plane import DONE_KEY

        try:
            self.store.set(DONE_KEY.format(self.ident), "1")
            self.store.check([DONE_KEY.format(self.ident)])
        except Exception:  # noqa: BLE001 - the agent is gone: nobody to tell
            pass

    def _say_done_at_exit(self) -> None:
        """At interpreter exit, unless an uncaught exception ends it (the interpreter records it in
        ``sys.last_value`` before the exit handlers run): a rank that fails is not done, even while it lingers."""
        if getattr(sys, "last_value", None) is None:
            self.say_done()

    # -- data ------------------------------------------------------------------------------------------
    def micro_batch(self, step: int, j: int) -> dict[str, torch.Tensor]:
        """Global micro-batch ``j`` of iteration ``step``: the same samples Megatron's sampler gives the
        global batch, whichever pipeline runs it (so a rerouted step trains on exactly the same data;
        ``samples.GlobalMicroBatches``)."""
        from torch.utils.data import default_collate

        self.at(step, "data")
        return default_collate([STATE.captured.train_ds[i] for i in self._global_micro_batches().indices(step, j)])

    def run_evaluation(self, forward_step_func: Callable[..., Any], data_iterator: Any) -> list[dict[str, Any]]:
        """One of ``evaluate``'s iterations over the current plan: the loss dictionaries that make its own
        arithmetic give stock's figure on every rank (megatron_lm.evaluation)."""
        from torch.utils.data import default_collate

        from .evaluation import EVAL, stock_loss_dicts

        split = EVAL.kind_of(data_iterator)
        dataset = STATE.captured.valid_ds if split == "valid" else STATE.captured.test_ds
        if dataset is None:
            raise RuntimeError(f"no {split} split was built (Megatron's build_train_valid_test_datasets), so "
                               f"Odyssey cannot read its samples after a failure")
        samples = self.eval_samples.get(split)
        if samples is None or samples.dataset is not dataset:
            samples = self.eval_samples[split] = GlobalMicroBatches(
                dataset, self.cfg.micro_batch, self.cfg.global_batch, self.cfg.dp,
                getattr(self.args, "dataloader_type", None) or "single", bool(getattr(self.args, "data_sharding", True)))
        position = EVAL.position(self.args)
        if position % self.cfg.global_batch:
            raise RuntimeError(f"the {split} split is at sample {position}, not a whole number of evaluation batches "
                               f"of {self.cfg.global_batch}")

        def micro_batch(at: int, j: int) -> dict[str, torch.Tensor]:
            return default_collate([dataset[i] for i in samples.indices(at // self.cfg.global_batch, j)])

        self.runner.forward_step_func = forward_step_func
        parts = self.executor.run_forward_only(micro_batch, position)
        pairs = torch.zeros(self.cfg.num_micro_batches, 2, dtype=torch.float32, device=self.device)
        if self.tp_rank == 0:  # (every TP rank of a last stage computes the same pairs)
            for j, loss_sum, tokens in parts:
                pairs[j, 0], pairs[j, 1] = loss_sum, tokens
        with communicating():
            dist.all_reduce(pairs)  # each row comes from one rank, zeros from the others: exact
        version = installed_version()
        return stock_loss_dicts(pairs, self.cfg.dp, per_micro_batch=version is not None and version.minor == 12)

    def _global_micro_batches(self) -> GlobalMicroBatches:
        if self.samples is None:
            self.samples = GlobalMicroBatches(STATE.captured.train_ds, self.cfg.micro_batch, self.cfg.global_batch,
                                              self.cfg.dp, getattr(self.args, "dataloader_type", None) or "single",
                                              bool(getattr(self.args, "data_sharding", True)),
                                              self.batch_ramp)
        return self.samples

    # -- generations -----------------------------------------------------------------------------------
    def _adopt_generation0(self, plan: ExecutionPlan) -> None:
        """Generation 0 is Megatron's own world, grid, model, schedule and DDP: nothing of ours runs
        in it but the commit guard (no groups, executor or gradient sync of ours are built)."""
        self.gen, self.plan, self.k = 0, plan, keys(0)
        self.rank_map = RankMap.for_plan(plan, self.cfg.tp)
        if self.rank_map.rank(self.node, self.tp_rank) != dist.get_rank():
            raise RuntimeError("Megatron's rank order is not tensor-, then data-, then pipeline-parallel")
        self._adopt_chunk(self.megatron_model[0])
        if len(self.megatron_model) > 1:  # interleaved: every chunk's parameters, by global name
            self.named = [pair for chunk in self.megatron_model
                          for pair in megatron_global_names(chunk, chunk_layer_start(chunk))]
        self._key_dropout(self.megatron_model)
        self.owners = unit_owners(self.plan)
        STATE.plan = None  # the dispatcher runs Megatron's own schedule
        # the process groups train() keeps for its whole run (a local of Megatron's train(), passed to
        # training_log): emptied at teardown and refilled with each new generation's, see teardown
        self.train_pgs = _pg_collection_of(self.model)

    def _adopt_private_world(self) -> None:
        """A joining rank before admission: Megatron's objects in its private world are placeholders that
        :meth:`enter` rebuilds on the admitted generation's groups; nothing is captured from them."""
        self.gen, self.k = -1, keys(-1)  # no generation of the job's yet (the abort watcher watches none)
        self.model, self.named, self.optimizer, self.shards = None, [], None, None
        STATE.plan = None
        self.train_pgs = _pg_collection_of(self.megatron_model[0])  # the object train() will hold (see teardown)

    def await_admission(self) -> None:
        """Ask the agent to join (after the job's ``--odyssey-rejoin`` moment, if it names this rank) and wait
        until the planner admits this rank; then Megatron's loop is set to start at the job's iteration. The
        generation is entered at the first iteration (:meth:`megatron_train_step`), after ``train()``'s set-up
        in the private world."""
        from ..runtime.joining import REJOIN_KEY, announce, wait_for_admission, wait_for_key
        from ..runtime.liveness import WAITING
        from .joining import resume_where_the_job_is

        if any(int(r["rank"]) == self.ident for r in self.cfg.extra.get("rejoin", [])):
            wait_for_key(self.store, REJOIN_KEY.format(self.ident), self.ident)
        self._start_heartbeat()
        announce(self.store, self.ident, launched=True)
        self.progress.set_state(WAITING)
        self.admission = wait_for_admission(self.store, self.ident)
        resume = int(self.admission[1]["resume_step"])
        self.committed, self.current_step = resume - 1, resume
        resume_where_the_job_is(self.args, self.scheduler, self.ident, resume)
        print(f"[odyssey rank {self.ident}] admitted into generation {self.admission[0]} at iteration {resume}",
              file=sys.stderr, flush=True)

    def _enter_admitted(self) -> None:
        """Leave the private world and enter the admitted generation (its stage, state from live replicas)."""
        gen, msg = self.admission
        self.admission = None
        with self.gen_lock:
            self.teardown()
            self.enter_admitted(gen, msg)

    def _adopt_chunk(self, chunk: Any) -> None:
        """This node's Megatron model chunk as the stage: its runner, its parameters by global name
        (model parameters: Megatron's DDP keeps their ``main_grad``) and the optimizer's state view."""
        start, _ = node_stage(self.plan, self.node)
        k, i = self.plan.position_of()[self.node]
        self.model = chunk
        self.runner = MegatronStageRunner(chunk, i == 0, i == self.plan.pipelines[k].length - 1)
        self.named = megatron_global_names(chunk, start)
        self.optimizer = OptimizerStateView(self.megatron_optimizer)

    def _key_dropout(self, chunks: list) -> None:
        """With dropout on, masks keyed to (seed, iteration, global micro-batch, layer), not to this rank
        (runtime.dropout_rng): a rerouted or re-placed micro-batch draws the masks it would have drawn."""
        if self.keyed_dropout:
            from ..runtime import dropout_rng

            for chunk in chunks:
                dropout_rng.install(chunk, int(self.args.seed), self.tp_rank)

    def _attach_stage(self) -> None:
        """Executor and per-layer gradient sync over Megatron's chunk and buffers (GenerationRank's hook)."""
        self._adopt_chunk(self.megatron_model[0])  # named back to model parameters after the restore
        self.sync = GradientSync(self.plan, self.groups, params_by_unit(self.named, self.cfg.layers), attr="main_grad",
                                 staged=self.p2p.staged, trace=self.trace, overlap=self.cfg.overlap_grad_reduce,
                                 tied=[p for n, p in self.named if self.tied_embeddings and n in TIED_NAMES])
        self.executor = PipelineExecutor(self.plan, self.groups, self.runner, self.micro_batch,
                                         (self.cfg.seq, self.cfg.micro_batch, self.cfg.hidden),
                                         dtype=_activation_dtype(self.args),
                                         per_token_loss=bool(getattr(self.args, "calculate_per_token_loss", False)),
                                         device=self.device, p2p=self.p2p,
                                         overlap=self.sync.overlapping if self.sync.overlap else None,
                                         loss_scale=loss_scale.backward_scale(self.megatron_optimizer, self.cfg.dp),
                                         **self.diagnosed())
        self.owners = unit_owners(self.plan)
        STATE.plan = self.plan

    def _build_model(self, start: int, end: int) -> None:
        """This generation's stage, built by Megatron's own ``get_model``/``get_megatron_optimizer`` and
        swapped into ``train()``'s objects; its state is restored by :meth:`enter` afterwards."""
        from megatron.training import training as mt

        captured = STATE.captured
        k, i = self.plan.position_of()[self.node]
        pre, post = i == 0, i == self.plan.pipelines[k].length - 1

        def provider(*a: Any, **kw: Any) -> Any:
            kw.update(pre_process=pre, post_process=post)
            return captured.model_provider(**kw)

        STATE.stage_range = (start, end)
        # Megatron's get_model derives the DDP config from args: from now on each layer is all-reduced over
        # the ranks holding it (runtime.grad_sync), so the new DDP must not start bucket reductions of its own
        # during backward (--overlap-grad-reduce, which generation 0 ran as it is)
        # (and generation 0's distributed optimizer gives way to Megatron's plain one cut down to replicated shards,
        # see megatron_lm.replica_optimizer: its DDP must not lay out buffers for the distributed optimizer's groups;
        # args go on saying the job runs the distributed optimizer, whose layout-free checkpoint format the
        # checkpoints written from now on use, so the job's own command line relaunches from them. megatron-core
        # before 0.15 has no such format: there the plain optimizer takes over, and args say so)
        if self.cfg.extra.get("replica_optimizer"):
            self.args.dist_ckpt_optim_fully_reshardable = True
        else:
            self.args.use_distributed_optimizer, self.args.num_distributed_optimizer_instances = False, 1
        # (and interleaving ends: a plan's stage is one contiguous layer range)
        self.args.virtual_pipeline_model_parallel_size = None
        for name in ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank"):
            if hasattr(self.args, name):
                setattr(self.args, name, None)
        with overridden(self.args, overlap_grad_reduce=False, overlap_param_gather=False,
                        use_distributed_optimizer=False, num_distributed_optimizer_instances=1):
            if "pg_collection" in inspect.signature(mt.get_model).parameters:
                chunks = mt.get_model(provider, captured.model_type, pg_collection=plan_process_groups(self.groups))
            else:  # Megatron-LM <= 0.15: get_model reads the groups from parallel_state (installed above)
                chunks = mt.get_model(provider, captured.model_type)
        (config, *rest), kwargs = captured.optimizer_call
        if getattr(config, "use_distributed_optimizer", False):
            config = dataclasses.replace(config, use_distributed_optimizer=False)
        fresh = mt.get_megatron_optimizer(config, chunks, *rest, **kwargs)
        self._key_dropout(chunks)
        self.megatron_model[:] = chunks
        fresh_pgs = _pg_collection_of(chunks[0])
        if self.train_pgs is not None and fresh_pgs is not None:
            self.train_pgs.__dict__.update(fresh_pgs.__dict__)
        self.megatron_optimizer.__dict__.clear()
        self.megatron_optimizer.__dict__.update(fresh.__dict__)
        loss_scale.load_scaler_states(self.megatron_optimizer, self.scaler_state)  # --fp16: as the last commit left it
        self._adopt_chunk(chunks[0])
        if self.cfg.extra.get("replica_optimizer"):  # the job asked for sharded optimizer state: keep it sharded
            self.shards = ReplicaShards(self.megatron_optimizer, self.named, self.groups.unit_groups, dist.get_rank(),
                                        self.cfg.layers, REPLICA_COPIES, staged=self.p2p.staged,
                                        tied_names=TIED_NAMES if self.tied_embeddings else (),
                                        tied_group=self.groups.tied_group)
        else:
            # named now refers to fp32 params the optimizer steps (restore writes values and Adam state there)
            self.named = [(n, self.optimizer.main_param(p)) for n, p in self.named]

    def enter(self, gen: int, plan: ExecutionPlan, policy: str, transfers: list, checkpoint_step: int | None) -> None:
        self.stock = False  # one-way hand-off: Odyssey's executor from now on
        if policy == "restart":  # some layer has no live copy: Megatron's own checkpoint, loaded in-process
            super().enter(gen, plan, policy, [], None)
            self._load_megatron_checkpoint(int(checkpoint_step))
        else:
            super().enter(gen, plan, policy, transfers, checkpoint_step)
        # bf16: the restored fp32 main copies -> the bf16 model weights (Megatron >= 0.15 wraps even a single
        # optimizer in a ChainedOptimizer, which does not have this method itself)
        for opt in sub_optimizers(self.megatron_optimizer):
            if hasattr(opt, "_copy_main_params_to_model_params"):
                opt._copy_main_params_to_model_params()
        if policy != "restart":  # (a restart loads the scalers and the schedule from Megatron's checkpoint)
            self._hand_over_to_admitted()
        self.scheduler.step(increment=0)  # the fresh optimizer's groups take the schedule's current lr
        members = tuple(node_ranks(self.rank_map.live_nodes, self.cfg.tp))
        log_writers.follow_the_last_rank(self.args, self.store, log_writers.HandOver(
            self.gen, self.ident, members, limit_s=self.cfg.soft_timeout_s / 2))

    def _hand_over_to_admitted(self) -> None:
        """--fp16: ranks admitted into this generation (a machine that came back, a standby put to work) take the
        loss scale and the schedule's step count from the lowest-ranked member that trained (loss_scale.hand_over);
        their Adam state came with the transfers. Every member knows the admitted ranks from the agent's message."""
        admitted = set((self.plan_message or {}).get("admitted") or ())
        if not admitted or not getattr(self.args, "fp16", False):
            return
        tp = self.cfg.tp
        trained = [self.rank_map.rank(n, t) for n in self.rank_map.live_nodes for t in range(tp)
                   if n * tp + t not in admitted]
        if not trained:
            raise OdysseyRestart(f"[odyssey] generation {self.gen} admits ranks {sorted(admitted)} and holds no rank "
                                 f"that trained: nobody has the loss scale to hand over")
        loss_scale.hand_over(self.megatron_optimizer, self.scheduler, min(trained), self.ident in admitted,
                             self._schedule_steps_committed())

    def _load_megatron_checkpoint(self, iteration: int) -> None:
        """Megatron's ``load_checkpoint`` of ``iteration`` into this generation's fresh stage (any layout: the
        torch_dist format is layout-free). Megatron's loop counters (consumed samples) are kept as they are:
        the lost iterations are trained again inside the next call (:meth:`_redo`), not by Megatron's loop.
        The RNG state is not loaded (saved in the original layout; dropout masks are keyed, see
        runtime.dropout_rng)."""
        from megatron.training import checkpointing

        args = self.args
        kept = {name: getattr(args, name, None) for name in
                ("no_load_rng", "ckpt_step", "finetune", "consumed_train_samples", "skipped_train_samples",
                 "consumed_valid_samples", "num_floating_point_operations_so_far")}
        args.no_load_rng, args.ckpt_step, args.finetune = True, iteration, False
        # to core_r0.14.0 load_checkpoint asserts a fresh job's zero sample counters (restored below, as they were)
        args.consumed_train_samples = args.skipped_train_samples = args.consumed_valid_samples = 0
        # Megatron's OptimizerParamScheduler.load_state_dict *adds* the saved step count to its own (it
        # expects a fresh scheduler): start it from zero, as a relaunched job would
        self.scheduler.num_steps = 0
        self.loading_checkpoint = True  # (what Megatron asks of the rerun state machine now is a load: hooks)
        try:
            checkpointing.load_checkpoint(self.megatron_model, self.megatron_optimizer, self.scheduler,
                                          load_arg="save", strict=True)
        finally:
            self.loading_checkpoint = False
            for name, value in kept.items():
                setattr(args, name, value)
        self.committed = iteration - 1  # the state now holds steps [0, iteration)
        self.saved = None  # a failure before this generation's first commit captures the loaded state
        print(f"[odyssey rank {self.ident}] loaded Megatron's checkpoint of iteration {iteration} in-process",
              file=sys.stderr, flush=True)

    def _redo(self, start: int, end: int) -> None:
        """Train steps [start, end) again after a restart from a checkpoint, inside the current call of
        Megatron's loop (which logs only its own iterations)."""
        with rerun.disabled():  # (an exit here would save the model under Megatron's later iteration)
            for step in range(start, end):
                self._train_plan_step(self.last_forward_step, step, self.last_forward_backward)

    def _abort_locked(self) -> None:
        with self.gen_lock:
            abort_all_groups()

    def recover(self, step: int) -> int:
        """GenerationRank.recover with the watcher kept out: no two threads may abort, destroy or create the
        same process groups at once (that ends the process in std::terminate)."""
        with self.gen_lock:
            return super().recover(step)

    # -- the host's hooks (see GenerationRank) -----------------------------------------------------
    def _capture(self) -> Any:
        from ..runtime.state import capture

        if distributed_optimizers(self.megatron_optimizer):  # generation 0's distributed optimizer
            state = capture_pieces(self.named, self.megatron_optimizer)
        elif self.shards is not None:  # a rebuilt stage's replicated shards, in this plan's layout
            state = self.shards.capture(self.plan)
        else:
            view = self.optimizer  # keyed by the fp32 parameters the optimizer steps (main copies under bf16)
            state = capture([(n, view.main_param(p)) for n, p in self.named], view)
        # generation 0 interleaved (rebuilt stages have one chunk): to the contiguous layout first
        return InterleavedCapture(state) if len(self.megatron_model) > 1 else state

    def _complete_state(self, saved: Any) -> Any:
        """Generation 0's state as the planner's base plan describes it: the distributed optimizer's shares
        -> each live holder's full stage state; interleaved chunks -> the contiguous stage of the same
        pipeline rank (megatron_lm.interleaved)."""
        interleaved = isinstance(saved, InterleavedCapture)
        state = saved.inner if interleaved else saved
        if isinstance(state, ShardedState) and state.plan is not None:
            tied = TIED_NAMES if self.tied_embeddings else ()
            groups, parts = unit_holder_groups(state.plan, set(self.rank_map.live_nodes), self.cfg.tp,
                                               self.rank_map.rank, self.cfg.layers, tied)
            state = reassemble(state, groups, dist.get_rank(), parts, aliases=TIED_ALIASES if tied else None)
        elif isinstance(state, ShardedState):
            groups = stage_holder_groups(self.cfg.pp, self.cfg.dp, self.cfg.tp, set(self.rank_map.live_nodes),
                                         self.rank_map.rank)
            state = reassemble(state, groups, dist.get_rank())
        if interleaved:
            state = self._to_contiguous(state)
        return state

    def _to_contiguous(self, state: dict) -> dict:
        from ..runtime import state as st

        cfg, live = self.cfg, set(self.rank_map.live_nodes)
        moves = reshuffle_transfers(cfg.layers, cfg.pp, cfg.dp, self.gen0_vpp, live)
        incoming = {unit - 1 for unit, _, dst in moves if dst == self.node}
        received = st.transfer(moves, self.node, self.tp_rank, self.rank_map.rank, cfg.layers, state,
                               shapes_for_layers(state, incoming), self.device, self.p2p)
        stage = self.node // cfg.dp  # the contiguous stage of this node's pipeline rank
        keep = self.gen0_plan.stage_units(0, stage)
        return {n: v for n, v in {**state, **received}.items() if unit_of(n, cfg.layers) in keep}

    def _release(self) -> None:
        self._release_megatron_objects()
        STATE.plan = None

    def _release_megatron_objects(self) -> None:
        """Drop every reference this process holds to the broken generation's model and optimizer (the
        state is captured): Megatron's DDP, its parameters' gradient hooks and its optimizer hold the
        generation's process groups, and a gloo group closes its connections only when it is freed
        (``abort()`` does not), so a peer blocked in, say, a DDP all-reduce with this rank would wait
        out its timeout. ``train()`` keeps the same list and optimizer objects; :meth:`_build_model`
        refills them."""
        from megatron.core.utils import get_model_config

        for chunk in self.megatron_model:
            config = get_model_config(chunk)
            for name in ("no_sync_func", "grad_sync_func", "param_sync_func"):
                if hasattr(config, name):
                    setattr(config, name, None)  # bound methods of the old DDP chunks
        self.megatron_model[:] = []
        if self.megatron_optimizer.__dict__:  # (a second release before a rebuild keeps the first one's)
            self.scaler_state = loss_scale.scaler_states(self.megatron_optimizer)
        self.megatron_optimizer.__dict__.clear()
        if self.train_pgs is not None:
            self.train_pgs.__dict__.clear()
        self.named, self.optimizer, self.shards = [], None, None
        STATE.last_losses = None  # the failed step's losses hold its autograd graph

    # -- steps -----------------------------------------------------------------------------------------
    def run_schedule(self, forward_step_func: Callable[..., Any], step: int) -> list[dict[str, torch.Tensor]]:
        """This rank's operations of the current plan for one iteration (what the dispatcher runs)."""
        self.runner.forward_step_func = forward_step_func
        self.last_result = self.executor.run_step(step, lambda: self.token_count(step),
                                                  on_op=lambda phase: self.at(step, phase))
        return [{"lm loss": torch.tensor([self.last_result.loss_sum, 1.0], device=self.device)}]

    def megatron_train_step(self, stock_step: Callable[[Callable[..., Any]], tuple], forward_step_func: Callable[..., Any], step: int,
                            forward_backward_func: Callable[..., Any]) -> tuple:
        """One of Megatron's iterations, redone on the next generation until some generation commits it.

        ``stock_step(forward_step_func)`` is Megatron's own ``train_step`` with the call's other
        arguments: generation 0 runs it (guarded, see :meth:`_stock_step`); later generations run
        :meth:`_step`."""
        self.current_step = step
        self.last_forward_step, self.last_forward_backward = forward_step_func, forward_backward_func
        if self.admission is not None:  # a joining rank's first iteration: into the job's generation
            self._enter_admitted()
        if not self.started:  # start-up is over: from now on a failure is recovered from
            self.store.set(STARTED_KEY.format(self.ident), "1")
            self.store.check([STARTED_KEY.format(self.ident)])  # a round trip: in the store before any fault fires
            self.started = True
        while True:
            failed = False
            try:
                self.entering(step)  # (before the step's first message: a drop waits for it, drop_gate)
                if self.stock:
                    result = self._stock_step(stock_step, forward_step_func, step)
                else:
                    result = self._step(forward_step_func, step, forward_backward_func)
                self.at_rest(step, "between")  # back in Megatron's loop (logging, saving)
                return result
            except Exception as exc:
                self._take_failure(exc, f"iteration {step}")
                rerun.abandon_step()
                failed = True
            if failed:
                resume = self.recover(step)
                if self.committed == step and resume == step + 1:
                    # the step was committed and applied before the failure reached this rank (in one of
                    # Megatron's collectives after its optimizer step): report it, do not redo it
                    loss, _ = parse_commit(self.store.get(f"{keys(self.gen - 1)['commit']}/{step}"))
                    self._finish_committed_stock_step()
                    return self._megatron_result(loss, not self.pending_overflow, self.pending_norm)
                self._catch_up(resume, step)

    # -- between iterations (see between_steps) -------------------------------------------------------
    def at_between_steps(self, phase: str) -> None:
        """An injection point of Megatron's loop after iteration ``committed`` (log, save)."""
        self.at_rest(self.committed, phase)

    def recover_outside_step(self, exc: BaseException, where: str) -> bool:
        """A failure in Megatron's loop between iterations (every step so far committed): recover into the
        agent's next generation, or leave the job if the error is this rank's own. Returns whether to run the
        interrupted call again: only if every survivor was in it (``redo_between``), since its collectives
        would wait for survivors that had already left it (they were in the next iteration)."""
        self._take_failure(exc, where)
        done = self.committed + 1
        self.between_steps = True
        try:
            self._catch_up(self.recover(self.committed), done)
        finally:
            self.between_steps = False
        return bool((self.plan_message or {}).get("redo_between", True))

    def _take_failure(self, exc: BaseException, where: str) -> None:
        """A failure reached this rank in ``where``: leave the job if the error is its own (a device bug, an
        OOM: reported), else abort this generation's groups so that recovery can begin."""
        if not is_peer_failure(exc, self.store, self.gen):
            fail_locally(self.store, self.ident, exc, where, abort=self._abort_locked)
        self._abort_locked()
        print(f"[odyssey rank {self.ident}] {where}: {type(exc).__name__}: {str(exc)[:120]}; recovering at "
              f"{time.time():.3f}", file=sys.stderr, flush=True)

    def _catch_up(self, resume: int, expected: int) -> None:
        """The agent resumes at ``resume`` where this rank expected ``expected``: earlier after a restart from a
        checkpoint (the lost steps are trained again now, before Megatron's loop goes on); later is a bug."""
        if resume < expected:
            self._redo(resume, expected)
        elif resume != expected:
            raise OdysseyRestart(f"[odyssey] the agent resumes at iteration {resume}, not {expected}")

    # -- generation 0: Megatron's own step, guarded --------------------------------------------------
    def _stock_step(self, stock_step: Callable[[Callable[..., Any]], tuple], forward_step_func: Callable[..., Any], step: int) -> tuple:
        """Megatron's ``train_step`` as it is, with its ``optimizer.step`` replaced for this call by
        :meth:`_guarded_optimizer_step`; faults are injected through the forward step function."""
        opt = self.megatron_optimizer
        self.timing = step in self.profile_window
        if self.timing:
            self._fb_timer().start(barrier=False)
        self.pending = step
        # inside the step from here on, for the agent's progress check: a later stage's first act in Megatron's
        # schedule is to receive its input, before its first forward marks anything, and a rank waiting there must
        # show as waiting on a peer in this step, not as still parked at the last stop of the previous iteration
        # (the agent would fence it as the rank the others wait for)
        self.progress.mark(step, "start")
        self.stock_messages.begin(step)  # (and this step's operation record)
        opt.step = functools.partial(self._guarded_optimizer_step, type(opt).step.__get__(opt), step)
        try:
            result = stock_step(self._injecting(forward_step_func, step))
        finally:
            opt.__dict__.pop("step", None)
        self.scheduled_before = None  # Megatron's train_step is through, its schedule step included
        if self.timing and step == self.profile_window[-1]:
            self._publish_profile()
        return result

    def _guarded_optimizer_step(self, megatron_step: Callable[[], tuple], step: int) -> tuple:
        """The commit guard: Megatron's own norm, *ready*, wait for *commit*, then Megatron's step (local:
        the norm it would all-reduce is the one computed before the commit)."""
        if self.timing:
            self._fb_timer().stop(barrier=False)
            self.timed_iterations += 1
        self.pending_overflow, self.pending_norm = self._megatron_grad_norm()
        # (Megatron's own count over its groups, before the commit: the step's call of it returns this one)
        self.pending_zeros = (float(self.megatron_optimizer.count_zeros())
                              if self.counts_zeros and not self.pending_overflow else None)
        self._publish_ready(step, *self._stock_loss_share())
        self._wait_commit(step)
        self.scheduled_before = getattr(self.scheduler, "num_steps", None)  # see _finish_committed_stock_step
        self.at(step, "optimizer")
        STATE.grad_norm, STATE.num_zeros = self.pending_norm, self.pending_zeros
        try:
            with deferred_param_sync(self.megatron_optimizer) as param_syncs, \
                    loss_scale.decided(self.megatron_optimizer, self.pending_overflow, self.scaler_updates):
                out = megatron_step()  # local: the distributed optimizer's all-gather is deferred
        finally:
            STATE.grad_norm = STATE.num_zeros = None
        self.committed, self.pending, self.saved = step, None, None
        for param_sync in param_syncs:  # a collective, after the step is this rank's own
            param_sync()
        return out

    def _finish_committed_stock_step(self) -> None:
        """Megatron's ``train_step`` steps the learning-rate schedule after ``optimizer.step`` and after a
        collective over the model-parallel group (``logical_and_across_model_parallel_group``): a failure
        in between leaves this rank's schedule one step behind the others. Step it as Megatron would have."""
        if self._schedule_behind():
            self.scheduler.step(increment=self.cfg.global_batch)
        self.scheduled_before = None

    def _schedule_behind(self) -> bool:
        """Whether the last committed stock step's schedule step is still to come (see above); a skipped
        (overflowed, --fp16) step has none: Megatron steps the schedule only after a successful update."""
        before = self.scheduled_before
        return (before is not None and getattr(self.scheduler, "num_steps", None) == before
                and not self.pending_overflow)

    def _schedule_steps_committed(self) -> int:
        """The schedule's step count once every committed step is through (what a joining rank takes over)."""
        steps = int(getattr(self.scheduler, "num_steps", 0))
        return steps + self.cfg.global_batch if self._schedule_behind() else steps

    def params_norm(self) -> float:
        """``--log-params-norm`` (``between_steps.params_norm``): over the plan, in every generation."""
        return plan_params_norm(self.named, self.owners, self.node, self.tp_rank, self.cfg.layers, self.device)

    def _megatron_grad_norm(self) -> tuple[bool, float | None]:
        """Whether the step overflowed (``--fp16``) and Megatron's own gradient norm (its groups, its fp32
        arithmetic: the stock clipping, bit for bit; none after an overflow, as stock), computed before the
        commit by Megatron's ``prepare_grads``, whose loss-scaler updates wait for the step
        (:mod:`.loss_scale`); the step's own call of it then returns this decision."""
        opt = self.megatron_optimizer
        if hasattr(opt, "prepare_grads") and hasattr(opt, "get_grad_norm"):
            with loss_scale.deferred_scaler_updates(opt) as self.scaler_updates:
                overflow = bool(opt.prepare_grads())
            return overflow, (None if overflow else float(opt.get_grad_norm()))
        self.scaler_updates = []
        return False, plan_grad_norm(self.named, self.owners, self.node, self.tp_rank, self.cfg.layers, self.device)

    def _stock_loss_share(self) -> tuple[float, float | None]:
        """This rank's share of the step's loss as Megatron's ``train_step`` reduces it: the sum of its
        micro-batches' loss sums and the sum of their token counts (the agent divides the totals, so the
        committed loss is Megatron's own figure; a micro-batch reported as one value counts as a mean)."""
        losses = STATE.last_losses or []
        if self.tp_rank != 0 or not losses:
            return 0.0, None
        numerator, tokens, means = 0.0, 0.0, 0.0
        for entry in losses:
            value = entry.get("lm loss") if isinstance(entry, dict) else None
            if value is None:
                continue
            if isinstance(value, (tuple, list)):  # megatron-core 0.12-0.13's loss_func: (loss sum, tokens)
                flat = torch.stack([v.detach().double().view(()) for v in value])
            else:
                flat = value.detach().double().view(-1)
            if flat.numel() == 2:
                numerator, tokens = numerator + float(flat[0]), tokens + float(flat[1])
            else:
                means += float(flat[0]) / self.cfg.num_micro_batches
        return (numerator, tokens) if tokens else (means, None)

    def _injecting(self, forward_step_func: Callable[..., Any], step: int) -> Callable[..., Any]:
        """Megatron's forward step with ``--odyssey-inject-fault`` points: before each micro-batch is
        fetched and run forward, and when its backward reaches the stage output."""
        at, timer = self.at, self.stock_timer
        from ..runtime.dropout_rng import set_micro_batch

        # one count per model chunk: the interleaved schedule runs each micro-batch once through every chunk
        local = {id(chunk): iter(range(self.cfg.num_micro_batches)) for chunk in self.megatron_model}
        replica, replicas = self.node % self.cfg.dp, self.cfg.dp
        per_micro_batch = bool(self.cfg.extra.get("loss_reduced_per_micro_batch"))  # (hooks)

        @functools.wraps(forward_step_func)
        def forward_step(*args: Any, **kwargs: Any) -> Any:
            at(step, "data")  # Megatron's forward step begins by fetching its micro-batch (get_batch)
            at(step, "forward")
            chunk = kwargs.get("model", args[1] if len(args) > 1 else None)
            counter = local.get(id(chunk)) or next(iter(local.values()))
            # Megatron's sampler gives data-parallel replica d the k-th slice of each global micro-batch group:
            # global micro-batch k * DP + d, as micro_batch() numbers them
            set_micro_batch(step, next(counter) * replicas + replica)
            with timer.timing("forward"):  # its batch and its forward (Megatron received the input before)
                out = loss_reduction_as_communication(forward_step_func(*args, **kwargs), per_micro_batch)
            tensor = out[0] if isinstance(out, tuple) else None
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda grad: at(step, "backward"))
            return out

        return forward_step

    def _fb_timer(self) -> Any:
        from megatron.training.global_vars import get_timers

        return get_timers()("odyssey-forward-backward", log_level=0)

    def _step(self, forward_step_func: Callable[..., Any], step: int, forward_backward_func: Callable[..., Any]) -> tuple:
        out = self._train_plan_step(forward_step_func, step, forward_backward_func)
        if isinstance(out, RerunExit):
            return self._megatron_exit(out)
        return self._megatron_result(*out)

    def _train_plan_step(self, forward_step_func: Callable[..., Any], step: int,
                         forward_backward_func: Callable[..., Any]) -> tuple[float, bool, float] | RerunExit:
        """One step of the current plan through the commit protocol: (committed loss, applied, norm); or, where
        Megatron's rerun state machine ends the job in it (:mod:`.rerun`), what ``train()`` is to do instead."""
        from megatron.training.global_vars import get_timers

        timers = get_timers()
        machine = rerun.machine()
        for _ in rerun.runs(machine):  # (again, in place, where the machine rejected a result)
            for chunk in self.megatron_model:
                chunk.zero_grad_buffer()
            self.megatron_optimizer.zero_grad()
            self.pending = step
            timers("forward-backward", log_level=1).start(barrier=False)
            forward_backward_func(forward_step_func=forward_step_func, data_iterator=None, model=self.megatron_model,
                                  num_microbatches=self.cfg.num_micro_batches, seq_length=self.cfg.seq,
                                  micro_batch_size=self.cfg.micro_batch, forward_only=False, odyssey_step=step)
            timers("forward-backward").stop()
            self.at(step, "grad-sync")
            self.sync()  # (waits for the reductions overlapped with the backward: the check reads their sums)
            self._sync_sequence_parallel_grads()
            rerun.check_grads([p.main_grad for _, p in self.named if getattr(p, "main_grad", None) is not None],
                              nan_or_inf=bool(getattr(self.args, "check_for_nan_in_loss_and_grad", False)),
                              large=bool(getattr(self.args, "check_for_large_grads", False)))
        leaving = rerun.exit_asked(machine)
        if leaving is not None:
            return leaving
        result = self.last_result
        norm = plan_grad_norm(self.named, self.owners, self.node, self.tp_rank, self.cfg.layers, self.device)
        # --fp16: the gradients are scaled by the loss scale; a non-finite sum of squares is an overflow, agreed
        # plan-wide by the norm's all-reduce (loss_scale)
        self.pending_norm = loss_scale.unscaled_norm(norm, self.megatron_optimizer, self.cfg.dp)
        self.pending_overflow = self.pending_norm is None
        self.pending_zeros = (plan_zero_count(self.named, self.owners, self.node, self.tp_rank, self.cfg.layers,
                                              self.device) if self.counts_zeros and not self.pending_overflow else None)
        self._publish_ready(step, 0.0, parts=result.loss_parts if self.tp_rank == 0 else [])
        loss = self._wait_commit(step)
        self.at(step, "optimizer")
        timers("optimizer", log_level=1).start(barrier=False)
        ok, norm = self._apply(step)
        timers("optimizer").stop()
        return loss, ok, norm

    # -- profiling with Megatron's timers ----------------------------------------------------------
    def _publish_profile(self) -> None:
        """Megatron's own forward-backward time per iteration over the profiling window (the timer
        ``odyssey-forward-backward`` around the stock schedule in generation 0, warm-up excluded, over
        ``self.timed_iterations`` iterations), for the agent to rescale the analytic profile to
        (``device_profile.calibrated_profile``). Timers see the whole schedule, not each layer."""
        from megatron.training.global_vars import get_timers

        n = self.timed_iterations  # counted by _guarded_optimizer_step in the profiling window
        if n < 1:
            return
        total = get_timers()("odyssey-forward-backward", log_level=0).elapsed(reset=True, barrier=False)
        self.store.set(f"odyssey/profile/{self.ident}", json.dumps({"forward_backward_s": total / n, "iterations": n}))

    def _sync_sequence_parallel_grads(self) -> None:
        """Megatron's ``_allreduce_non_tensor_model_parallel_grads``: with sequence parallelism, norm
        weights are replicated over TP ranks but see different tokens, so their grads are summed."""
        if self.cfg.tp == 1 or not getattr(self.args, "sequence_parallel", False):
            return
        grads = [p.main_grad for _, p in self.named if getattr(p, "sequence_parallel", False)]
        if grads:
            for g, reduced in zip(grads, all_reduce_flat(grads, self.groups.tp_group)):
                g.copy_(reduced)

    def _apply(self, step: int) -> tuple[bool, float]:  # type: ignore[override]
        """The committed step, locally: no collective may run after the commit."""
        STATE.grad_norm, STATE.num_zeros = self.pending_norm, self.pending_zeros
        try:
            # no collective may run here: generation 0's distributed optimizer updates its shard locally and
            # its parameter all-gather is dropped (this runs in a recovery, whose capture takes the shards)
            with deferred_param_sync(self.megatron_optimizer), \
                    loss_scale.agreed_overflow(self.megatron_optimizer, self.pending_overflow, self.cfg.dp):
                ok, norm, _ = self.megatron_optimizer.step()
        except Exception as exc:  # (a local step's error is this rank's own; in a recovery, where the broken
            # generation makes every error look like a peer's, the retry would fail the same way again and again)
            fail_locally(self.store, self.ident, exc, f"the optimizer step of step {step}, committed",
                         abort=self._abort_locked)
        finally:
            STATE.grad_norm = STATE.num_zeros = None
        if ok:
            self.scheduler.step(increment=self.cfg.global_batch)
        self.committed, self.pending, self.saved = step, None, None
        if ok and self.shards is not None:  # a collective, after the step is this rank's own
            self.shards.gather_params()
        return ok, norm

    def _rebuild_facts(self) -> dict[str, Any]:
        if self.shards is None:
            return {}
        return {"optimizer_share": self.shards.kept_numel() / max(1, sum(p.numel() for _, p in self.named))}

    def _restore(self, state: Any) -> None:
        if self.shards is not None:
            self.shards.restore(state)
        else:
            super()._restore(state)

    def _megatron_exit(self, leaving: RerunExit) -> tuple:
        """What Megatron's ``train_step`` returns where its rerun state machine ends the job: ``train()`` saves a
        checkpoint where asked, and leaves with the code."""
        base = ({}, True, leaving.checkpoint, True, leaving.code, None, None)
        return base + (0,) if self.arity == 8 else base

    def _megatron_result(self, loss: float, ok: bool, norm: float) -> tuple:
        """What Megatron's ``train_step`` returns, and the consumed-sample count kept right: ``train()``
        adds data-parallel size x micro-batch x micro-batches, which differs from the (fixed) global
        batch once a plan is not a uniform grid."""
        from megatron.core import parallel_state as mpu
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        self.args.consumed_train_samples += self.cfg.global_batch - (
            mpu.get_data_parallel_world_size() * self.cfg.micro_batch * get_num_microbatches())
        loss_dict = {"lm loss": torch.tensor(loss, device=self.device)}
        base = (loss_dict, 0 if ok else 1, False, False, 0, norm, self.pending_zeros if ok else None)
        return base + (0,) if self.arity == 8 else base


def _pg_collection_of(model: Any) -> Any:
    """The chunk's process-group collection (megatron-core 0.15+), or None (0.12-0.14 read parallel_state)."""
    from megatron.core.utils import get_attr_wrapped_model

    try:
        return get_attr_wrapped_model(model, "pg_collection")
    except RuntimeError:  # not found (0.12-0.14's get_attr_wrapped_model has no allow_none)
        return None


def _store_or_none() -> Any:
    """A client of the agent's store, for reporting a start-up error (None if it cannot be reached)."""
    try:
        host, port = os.environ[STORE_ENV].rsplit(":", 1)
        return client((host, int(port)), 10)
    except Exception:
        return None


def _activation_dtype(args: Any) -> torch.dtype:
    return torch.bfloat16 if getattr(args, "bf16", False) else (torch.float16 if getattr(args, "fp16", False) else torch.float32)


def _original_train_step() -> Callable[..., Any]:
    from megatron.training import training as mt

    fn = mt.train_step
    return getattr(fn, ORIGINAL_ATTR, fn)


def train_step(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron's ``train_step``, replaced under ``--odyssey`` by the commit-and-redo step above."""
    from .hooks import odyssey_enabled

    @functools.wraps(original)
    def wrapper(forward_step_func: Any, data_iterator: Any, model: list, optimizer: Any, opt_param_scheduler: Any,
                *args: Any, **kwargs: Any) -> tuple:
        if not odyssey_enabled():
            return original(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, *args, **kwargs)
        from megatron.training.global_vars import get_args

        margs = get_args()
        fbf = kwargs.get("forward_backward_func") or (args[1] if len(args) > 1 else None)
        if fbf is None:  # megatron-core <= 0.13 looks the schedule up inside train_step
            from megatron.training import training as mt

            fbf = mt.get_forward_backward_func()
        if STATE.runtime is None:
            try:
                STATE.runtime = MegatronRank(margs, model, optimizer, opt_param_scheduler)
            except Exception as exc:  # start-up: the agent (or launcher) ends the job with this error
                fail_locally(_store_or_none(), int(os.environ.get("RANK", "-1")), exc, "start-up")

        def stock_step(injected_forward_step: Callable[..., Any]) -> tuple:
            return original(injected_forward_step, data_iterator, model, optimizer, opt_param_scheduler,
                            *args, **kwargs)

        return STATE.runtime.megatron_train_step(stock_step, forward_step_func, int(margs.curr_iteration), fbf)

    return wrapper

