"""The registry of every change Odyssey makes to Megatron: one :class:`Patch` per Megatron name
it replaces, with a factory that wraps the original and the reason. :mod:`megatron_odyssey.megatron_adaptor`
applies them all when a Megatron-LM script imports it; the standalone trainer applies only the
megatron-core ones it needs (:func:`apply_patches` with ``only``).

Aliases matter: ``from x import f`` copies the name, so a function used through such an import is
patched where it is used (``initialize.parse_args``, ``training.get_forward_backward_func``...).
"""
from __future__ import annotations

import functools
import importlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ..runtime.liveness import communicating
from . import hooks
from .hooks import ORIGINAL_ATTR
from .versions import installed_version, unknown_version_error


@dataclass(frozen=True)
class Patch:
    target: str  # "package.module:attribute" or "package.module:Class.attribute"
    wrap: Callable[[Any], Any]  # original -> replacement
    why: str
    releases: tuple[int, int] = (12, 20)  # megatron-core minor versions whose code has the target

    def expected_in(self, minor: int) -> bool:
        return self.releases[0] <= minor <= self.releases[1]

    @property
    def module(self) -> str:
        return self.target.split(":")[0]

    @property
    def path(self) -> list[str]:
        return self.target.split(":")[1].split(".")


# -- replacements that need Megatron-LM's training package (imported lazily) ---------------------------

def _parse_args(original: Callable[..., Any]) -> Callable[..., Any]:
    """Chains the --odyssey-* group into whatever extra_args_provider the script passes."""
    from ..arguments import add_odyssey_args

    @functools.wraps(original)
    def parse_args(extra_args_provider: Callable[..., Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        def provider(parser: Any) -> Any:
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            return add_odyssey_args(parser)

        return original(provider, *args, **kwargs)

    return parse_args


def _validate_args(original: Callable[..., Any]) -> Callable[..., Any]:
    import contextlib

    from ..arguments import OdysseyArgumentError, validate_odyssey_args
    from . import joining

    @functools.wraps(original)
    def validate_args(args: Any, *a: Any, **k: Any) -> Any:
        # a rank joining a running job (odyssey-launch --join) starts in a private world of its own
        rejoining = getattr(args, "odyssey", False) and joining.join_rank() is not None
        try:
            if rejoining:
                joining.private_layout(args)
            out = original(args, *a, **k)
            with joining.as_the_job(args) if rejoining else contextlib.nullcontext():
                validate_odyssey_args(args)
            if getattr(args, "odyssey", False):
                check_release()
        except OdysseyArgumentError as exc:
            raise SystemExit(f"odyssey: {exc}") from None
        return out

    return validate_args


def _finalize_model_grads(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def finalize_model_grads(model: Any, *args: Any, **kwargs: Any) -> Any:
        runtime = hooks.STATE.runtime
        if runtime is None or runtime.sync is None:
            if runtime is None:
                return original(model, *args, **kwargs)
            runtime.at(runtime.current_step, "grad-sync")  # generation 0: Megatron's own DDP reduction
            entered = time.time()
            # (a rank there waits for its data-parallel peers: a peer stopped in its own work, still in its
            # pipeline's backward, is the one to blame, however early this rank got here; counted as its own work,
            # this rank stopped first and was fenced instead of the stalled peer)
            with communicating():
                out = original(model, *args, **kwargs)
            runtime.stock_messages.all_reduced(entered, time.time())  # who held up the data-parallel peers
            return out
        runtime.sync()  # per layer, over exactly the ranks holding it
        return None

    return finalize_model_grads


def _wrapper(module: str, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The wrapper ``name`` of ``module`` (relative to this package), imported only when the patch is applied: the
    registry itself is read (flags, version checks) without importing torch or Megatron, which those modules do."""

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        return getattr(importlib.import_module(module, __package__), name)(original)

    return wrap


def _deferred_param_gather(original: Callable[..., Any]) -> Callable[..., Any]:
    from . import between_steps

    return between_steps.deferred_param_gather(hooks.stock_param_gather_only(original))


_T, _C = "megatron.training", "megatron.core"

#: The registry: one entry per Megatron name Odyssey replaces.
PATCHES: tuple[Patch, ...] = (
    # the end of the job
    Patch(f"{_T}:pretrain", _wrapper(".clean_exit", "leave_with_groups_destroyed"),
          "Megatron leaves its process groups to interpreter exit, where a gloo worker thread can still hold a "
          "finished collective and abort the process (pytorch#190489): after a clean end they are destroyed "
          "first (clean_exit)"),
    # arguments
    Patch(f"{_T}.arguments:parse_args", _parse_args,
          "pretrain_gpt.py passes no extra_args_provider for plugins: the --odyssey-* group is chained in here"),
    Patch(f"{_T}.initialize:parse_args", _parse_args, "initialize_megatron calls its own imported alias",
          releases=(12, 17)),
    Patch(f"{_T}.arguments:validate_args", _validate_args,
          "rejects flag combinations Odyssey cannot run (distributed optimizer, overlapped grad reduce, ...) "
          "once world and data-parallel sizes are known"),
    Patch(f"{_T}.initialize:validate_args", _validate_args, "initialize_megatron calls its own imported alias",
          releases=(12, 17)),
    # schedule
    Patch(f"{_C}.pipeline_parallel:get_forward_backward_func", _wrapper(".schedule", "get_forward_backward_func"),
          "returns a dispatcher that picks the stock schedule or this node's plan schedule at every call"),
    Patch(f"{_T}.training:get_forward_backward_func", _wrapper(".schedule", "get_forward_backward_func"),
          "train() captures the schedule once before its loop: the captured object must switch after a failure"),
    Patch(f"{_C}.pipeline_parallel.schedules:backward_step", hooks.timed_backward_step,
          "before the first failure Megatron's own 1F1B runs the compute: its backward operations are timed "
          "there for the diagnosis of slow ranks (and slowed by an injected slowdown); behaviour unchanged"),
    Patch(f"{_C}.pipeline_parallel.p2p_communication:_communicate", hooks.traced_p2p,
          "before the first failure Megatron's own 1F1B moves activations and gradients: its messages are noted "
          "there for the diagnosis of slow links (and held back by an injected slow link); behaviour unchanged",
          releases=(12, 13)),
    Patch(f"{_C}.pipeline_parallel.p2p_communication:P2PCommunicator._communicate", hooks.traced_p2p,
          "0.14+: the same, now a method of the schedule's communicator", releases=(14, 20)),
    # a machine that comes back (megatron_lm.joining)
    Patch(f"{_T}.training:train", _wrapper(".joining", "join_before_train"),
          "a rank joining a running job (odyssey-launch --join) set Megatron up in a private world; before the "
          "loop starts it waits for the agent's admission, and the loop starts at the job's iteration"),
    # the step: commit and redo, gradients, norm
    Patch(f"{_T}.training:train_step", _wrapper(".rank", "train_step"),
          "generation 0 runs Megatron's own step with a commit guard before the optimizer; after a failure "
          "an iteration is executor -> per-layer grad sync -> plan-wide norm -> commit -> optimizer, "
          "redone on the next generation when a rank fails before the commit"),
    Patch(f"{_T}.training:finalize_model_grads", _finalize_model_grads,
          "DDP all-reduces whole buckets over one data-parallel group; after a failure, layers of "
          "non-uniform plans are held by different rank sets and are all-reduced per layer (generation 0 "
          "keeps Megatron's own reduction)"),
    Patch(f"{_C}.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.start_grad_sync", hooks.grad_sync_once,
          "with --overlap-grad-reduce and 2+ distributed-optimizer instances stock Megatron-LM (from core_r0.16.0; "
          "0.14 and 0.15 reduce once) reduces each step's "
          "gradients twice under pipeline parallelism (backward hook and the schedule's grad_sync_func; its "
          "second-dispatch guard needs an async handle those instances never leave): reduced once under --odyssey; "
          "and (core_r0.16.0) its reduction stream waits for the default stream only while the gradient hooks run on "
          "DDP's set-up stream: it waits for the caller's stream too, as core_r0.17.0 does"),
    Patch(f"{_C}.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.finish_grad_sync",
          hooks.grad_sync_finished, "ends the step's one reduction (start_grad_sync above); behaviour unchanged"),
    Patch(f"{_C}.optimizer.optimizer:get_grad_norm_fp32", hooks.grad_norm_fp32,
          "the stock norm all-reduces over the uniform model-parallel group, after the commit; Odyssey "
          "computes it over the plan before the commit and the optimizer reuses it"),
    Patch(f"{_C}.rerun_state_machine:RerunStateMachine.should_run_forward_backward", hooks.rerun_check_waits_on_peers,
          "train_step's rerun check after the forward-backward all-reduces over the world (0.15+: _reduce_any; to "
          "0.14 inline): marked as communication, so a rank waiting there on peers still in their gradient reduction "
          "is not taken for the one stopped in its own work (behaviour unchanged)"),
    Patch(f"{_C}.optimizer.optimizer:count_zeros_fp32", hooks.zeros_counted_before_commit,
          "core_r0.12.0's ChainedOptimizer.step counts zeros (an all-reduce) even without --log-num-zeros-in-grad, "
          "after the commit; inside Odyssey's committed steps it returns the count made before the commit"),
    Patch(f"{_T}.training:should_disable_forward_pre_hook", hooks.stock_param_gather_only,
          "with --overlap-param-gather train() switches the chunks' forward pre-hooks (the deferred weight "
          "all-gather) around saves and forces the all-gather; rebuilt stages gather right after the step and have "
          "no such hooks: False after the first failure"),
    Patch(f"{_T}.training:disable_forward_pre_hook", _deferred_param_gather,
          "train()'s end removes the pre-hooks it enabled after its first step, on chunks a failure replaced: "
          "a no-op after the first failure; before it, its forced weight all-gather (before an evaluation, at the "
          "end) runs outside train_step: a peer's failure there is recovered from (megatron_lm.between_steps)"),
    # stages of any layer range (group installation itself is runtime.world.install_parallel_state)
    Patch(f"{_C}.transformer.transformer_block:get_num_layers_to_build", hooks.num_layers_to_build,
          "derives a stage's layer count from a uniform split; asymmetric plans give each stage its own"),
    Patch(f"{_C}.transformer.transformer_layer:get_transformer_layer_offset", hooks.layer_offset,
          "derives a stage's first layer number from a uniform split (TransformerLayer keeps global numbers)"),
    Patch(f"{_C}.transformer.transformer_block:get_transformer_layer_offset", hooks.layer_offset,
          "TransformerBlock's imported alias (local <-> global layer names in sharded state dicts)"),
    # failures between iterations (megatron_lm.between_steps)
    Patch(f"{_T}.training:training_log", _wrapper(".between_steps", "training_log"),
          "its interval barrier and timer all-gathers run over the world outside train_step: a peer's failure "
          "there is recovered from, and the log line abandoned; it divides by args.world_size for the throughput "
          "and energy per GPU: the live world's while it runs; (0.16+) a rank that joined the running job logs its "
          "first iteration as the job's steady state, not as train()'s first, whose loss totals stay for the next "
          "line"),
    Patch(f"{_T}.training:save_checkpoint_and_time", _wrapper(".between_steps", "save_checkpoint_and_time"),
          "its timer barrier and the save run over the world outside train_step: a peer's failure there is "
          "recovered from and the save redone by the survivors"),
    Patch(f"{_T}.training:save_checkpoint", _wrapper(".between_steps", "save_checkpoint"),
          "the final save (pretrain) and every interval save: an interrupted save is redone, never marked latest"),
    Patch(f"{_T}.training:checkpoint_and_decide_exit", _wrapper(".between_steps", "checkpoint_and_decide_exit"),
          "after every iteration, outside train_step, --exit-signal-handler gathers each rank's SIGTERM flag and "
          "--exit-duration-in-mins all-reduces the elapsed time over the world: a peer's failure there is recovered "
          "from and the check run again; once it decides to exit, train()'s next world barrier (0.18+: "
          "torch.distributed.barrier() before sys.exit) is guarded the same way, for that one call"),
    Patch(f"{_T}.training:check_adlr_autoresume_termination",
          _wrapper(".between_steps", "check_adlr_autoresume_termination"),
          "--adlr-autoresume: a world barrier every --adlr-autoresume-interval iterations outside train_step, then "
          "a save: a peer's failure there is recovered from and the check run again"),
    Patch(f"{_C}.energy_monitor:EnergyMonitor.lap", _wrapper(".energy", "lap"),
          "--log-energy: train() calls it once more after its loop, a world all-reduce outside every guarded call: "
          "recovered from there (megatron_lm.energy)", releases=(13, 20)),
    Patch(f"{_C}.energy_monitor:EnergyMonitor.get_total", _wrapper(".energy", "get_total"),
          "--log-energy: train()'s closing total, a world all-reduce outside every guarded call: recovered from",
          releases=(13, 20)),
    Patch(f"{_T}.training:print_datetime", _wrapper(".between_steps", "print_datetime"),
          "pretrain calls it after train() returns, a world barrier before the final save and validation: a peer's "
          "failure after the last iteration is recovered from there and the final checkpoint still written"),
    Patch(f"{_T}.training:calc_params_l2_norm", _wrapper(".between_steps", "params_norm"),
          "--log-params-norm: after every iteration, outside train_step, it all-reduces over the uniform "
          "model-parallel group, which after a failure holds part of a pipeline (a wrong norm is printed), and "
          "completes for ranks whose groups lost nobody (they meet a failure in the next call, the others here): the "
          "norm over the plan with one all-reduce over the world instead, a peer's failure there recovered from"),
    *(Patch(f"{_C}.timers:Timer.{name}", _wrapper(".between_steps", "guarded_timer_barrier"),
            f"train() calls Timer.{name}(barrier=True) around an evaluation, a world barrier outside train_step and "
            f"outside the calls guarded here: a peer's failure there is recovered from, and the barrier passed in the "
            f"new layout") for name in ("start", "stop", "elapsed")),
    Patch(f"{_T}.training:evaluate", _wrapper(".evaluation", "evaluate"),
          "its barrier, schedule and reductions run over the world outside train_step: a peer's failure there is "
          "recovered from and the evaluation redone from where it began (its schedule call after a failure runs "
          "the plan forward-only: megatron_lm.evaluation)"),
    Patch(f"{_T}.training:build_train_valid_test_data_iterators", _wrapper(".evaluation", "capture_eval_iterators"),
          "remembers which iterator is the validation split's and which the test split's, so that an evaluation "
          "after a failure reads the right split by index"),
    # Megatron's own fault injector (megatron_lm.fault_injection)
    Patch(f"{_C}.fault_injector:setup_fault_injection", _wrapper(".fault_injection", "setup_on_the_survivors"),
          "--fault-injector-delay-start-iteration reached after a failure: Megatron's plans on the world's rank 0 and "
          "broadcasts over the world, now the survivors' (renumbered); each survivor draws the same plan instead, "
          "with launch-time target ranks. A machine that joins does not set up again an injection timed from the "
          "job's start", releases=(18, 20)),
    # checkpoints written after a recovery (megatron_lm.checkpoint)
    Patch(f"{_T}.checkpointing:generate_state_dict", hooks.plan_replica_state_dict,
          "replica ids come from the data-parallel rank, 0 on every rank under our parallel_state: after a "
          "recovery one holder per layer (its owner) must be the main replica, the others replicas"),
    Patch(f"{_T}.checkpointing:get_rng_state", hooks.original_layout_rng_state,
          "the RNG state is sharded by pipeline rank (0 of 1 under our parallel_state): written in the "
          "original stage x TP layout, one live rank per slot, so a stock job finds every slot"),
    Patch(f"{_C}.rerun_state_machine:RerunStateMachine.state_dict", hooks.original_layout_rerun_state,
          "its per-rank state is sharded by the world's size and rank (0.14+; 0.18+: at every save; to 0.13 by "
          "pipeline stage and TP rank, at every save): after a recovery written and read in the launch's layout, so "
          "a relaunch at the original size, and an in-process restart from an earlier checkpoint, find every slot"),
    Patch(f"{_C}.rerun_state_machine:RerunStateMachine.load_state_dict", hooks.own_rerun_state,
          "a load after a recovery asks for every slot a save would write (Megatron checks the same access "
          "pattern): the rank's own slot, the first, is the one loaded"),
    # the batch (before pretrain_gpt.py imports its alias)
    Patch(f"{_T}.utils:get_batch_on_this_tp_rank", hooks.whole_batch_on_every_stage,
          "with TP > 1, tensor-parallel rank 0 broadcasts only what its pipeline stage needs, judged by "
          "args.pipeline_model_parallel_size and the stage; after a failure every rank is stage 0 of 1 to "
          "Megatron, so the other TP ranks would get no labels: each stage gets the whole batch",
          releases=(12, 17)),
    Patch(f"{_C}.utils:get_batch_on_this_tp_rank", hooks.whole_batch_on_every_stage,
          "0.18+ keeps labels only where is_pipeline_last_stage(); after a failure every rank is stage 0 of 1 "
          "to Megatron, so each stage reads the whole batch", releases=(18, 20)),
    Patch(f"{_C}.models.common.language_module.language_module:LanguageModule.setup_embeddings_and_output_layer",
          hooks.tied_embedding_setup,
          "with tied embeddings it zero-fills a last stage's copy of the word embeddings and all-reduces it over the "
          "embedding group (asserting, from 0.14, that the stage is not also the first); a rebuilt stage gets its "
          "values from live copies, so only the parameter marks are set"),
    # capture what a rebuild needs
    Patch(f"{_T}.training:get_model", hooks.capture_get_model,
          "remembers the model provider, to rebuild a stage after a failure with Megatron's own get_model"),
    Patch(f"{_T}.models.gpt:GPTModelBuilder.build_distributed_models", hooks.capture_model_builder,
          "0.19+ pretrain() builds the model through this config-driven builder instead of get_model: remembers "
          "a provider over its build_model for rebuilds", releases=(19, 20)),
    Patch(f"{_T}.training:get_megatron_optimizer", hooks.capture_get_optimizer,
          "remembers the optimizer arguments (they differ between megatron-core versions) for rebuilds"),
    Patch(f"{_T}.training:build_train_valid_test_datasets", hooks.capture_datasets,
          "keeps the training split so any rank can read any (iteration, micro-batch) after a reroute"),
    # decoupled back-propagation (filled reroutes)
    Patch(f"{_C}.tensor_parallel.layers:LinearWithGradAccumulationAndAsyncCommunication.backward",
          _wrapper("..runtime.weight_grad", "linear_backward"),
          "computes input and weight gradients together; inside a filled reroute's B only the input "
          "gradient is computed and the weight gradient is left for the plan's later W (runtime.weight_grad)"),
    Patch(f"{_C}.datasets.blended_megatron_dataset_builder:BlendedMegatronDatasetBuilder.__init__",
          hooks.build_datasets_everywhere,
          "stock Megatron builds datasets on first/last stages only; after a failure any rank can become one"),
)

_LOCK = threading.RLock()
_APPLIED: dict[str, tuple[Any, str, Any]] = {}  # target -> (owner, attribute, original)
_SKIPPED: dict[str, str] = {}  # target -> why it was not applied


def _owner(patch: Patch) -> tuple[Any, str]:
    owner: Any = importlib.import_module(patch.module)
    for name in patch.path[:-1]:
        owner = getattr(owner, name)
    return owner, patch.path[-1]


def apply_patches(only: Iterable[str] | None = None) -> dict[str, str]:
    """Apply every patch whose module imports (idempotent: a patched name is never wrapped twice);
    ``only``: just these targets (the standalone trainer needs megatron-core's, not Megatron-LM's)."""
    wanted = None if only is None else set(only)
    with _LOCK:
        for patch in PATCHES:
            if patch.target in _APPLIED or (wanted is not None and patch.target not in wanted):
                continue
            try:
                owner, attr = _owner(patch)
                original = getattr(owner, attr)
            except (ImportError, AttributeError) as exc:
                _SKIPPED[patch.target] = f"{type(exc).__name__}: {exc}"
                continue
            _SKIPPED.pop(patch.target, None)
            replacement = patch.wrap(original)
            setattr(replacement, ORIGINAL_ATTR, original)
            setattr(owner, attr, replacement)
            _APPLIED[patch.target] = (owner, attr, original)
        return patch_status()


def remove_patches() -> None:
    """Put every original back (idempotent)."""
    with _LOCK:
        for target in list(_APPLIED):
            owner, attr, original = _APPLIED.pop(target)
            setattr(owner, attr, original)
        _SKIPPED.clear()


def patch_status() -> dict[str, str]:
    """target -> "applied" or the reason it was skipped."""
    return {p.target: "applied" if p.target in _APPLIED else _SKIPPED.get(p.target, "not applied")
            for p in PATCHES}


def missing_patches(minor: int) -> dict[str, str]:
    """Targets this release's code should have but that did not apply, and why (empty: fully patched)."""
    status = patch_status()
    return {p.target: status[p.target] for p in PATCHES if p.expected_in(minor) and status[p.target] != "applied"}


def check_release() -> None:
    """--odyssey needs a megatron-core release we know, with every patch its code should take applied."""
    from ..arguments import OdysseyArgumentError

    version = installed_version()
    if version is None or not version.known:
        raise OdysseyArgumentError(unknown_version_error(version))
    missing = missing_patches(version.minor)
    if missing:
        raise OdysseyArgumentError(
            f"megatron-core {version} ({version.branch}) should take every patch of megatron_odyssey's registry, "
            f"but these did not apply: " + "; ".join(f"{t} ({why})" for t, why in missing.items()))


#: What is applied on a release we do not know: only the flags, so ``--odyssey`` is refused clearly.
ARGUMENT_TARGETS = (f"{_T}.arguments:parse_args", f"{_T}.initialize:parse_args",
                    f"{_T}.arguments:validate_args", f"{_T}.initialize:validate_args")


def apply_for_installed_release() -> dict[str, str]:
    """All patches on a known release; on any other only :data:`ARGUMENT_TARGETS` (never half-patched)."""
    version = installed_version()
    return apply_patches(only=None if version is None or version.known else ARGUMENT_TARGETS)


def describe_patches() -> list[dict[str, str]]:
    return [{"target": p.target, "why": p.why} for p in PATCHES]


