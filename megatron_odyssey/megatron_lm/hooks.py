"""What the Megatron adaptor's patches call: the replacement functions and the little state they share.

Kept apart from :mod:`megatron_odyssey.megatron_adaptor` (which only says *where* each replacement
goes and why) so the behaviour is testable with the megatron-core wheel alone. Everything here is
inert until a rank's Odyssey runtime activates it: with no runtime, every replacement defers to the
Megatron original it wraps, so importing the adaptor never changes a job that did not ask for
``--odyssey``.
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ..planning.plan import ExecutionPlan

#: set by the adaptor's registry on every replacement: the Megatron original it wraps
ORIGINAL_ATTR = "__odyssey_original__"


@dataclass
class Captured:
    """What Megatron's own set-up calls revealed, needed to rebuild a stage after a failure."""

    model_provider: Callable[..., Any] | None = None
    model_type: Any = None
    optimizer_call: tuple[tuple, dict] | None = None  # get_megatron_optimizer's arguments after model_chunks
    train_ds: Any = None
    valid_ds: Any = None  # the evaluation splits (megatron_lm.evaluation)
    test_ds: Any = None


@dataclass
class OdysseyState:
    """Per-process switchboard between Megatron's code and this rank's Odyssey runtime."""

    runtime: Any = None  # rank.MegatronRank once train() starts
    plan: ExecutionPlan | None = None  # the plan the dispatcher schedules for
    stage_range: tuple[int, int] | None = None  # layers [start, end) while a stage model is being built
    grad_norm: float | None = None  # this step's plan-wide norm, agreed before the commit
    num_zeros: float | None = None  # ... and its gradient's zero count, where the release counts (see below)
    last_losses: Any = None  # what Megatron's own schedule returned last (generation 0)
    joining: dict[str, Any] | None = None  # a rank joining a running job: its own values of args (megatron_lm.joining)
    captured: Captured = field(default_factory=Captured)


STATE = OdysseyState()


def reset_state() -> None:
    """Forget everything (tests; a process that runs several jobs)."""
    global STATE
    STATE.__init__()  # type: ignore[misc]


@contextlib.contextmanager
def overridden(obj: Any, **values: Any) -> Iterator[None]:
    """``obj``'s attributes set to ``values`` for a call of Megatron's that reads them (``args`` mostly), and
    put back afterwards (an attribute it did not have is removed again)."""
    kept = {name: getattr(obj, name) for name in values if hasattr(obj, name)}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name in values:
            if name in kept:
                setattr(obj, name, kept[name])
            else:
                delattr(obj, name)


def sub_optimizers(megatron_optimizer: Any) -> list[Any]:
    """The optimizers inside a Megatron ``ChainedOptimizer`` (megatron-core >= 0.15 wraps even a single one), or
    the one given."""
    return list(getattr(megatron_optimizer, "chained_optimizers", [megatron_optimizer]))


# -- stage layer ranges (non-uniform plans) -------------------------------------------------------------

def num_layers_to_build(original: Callable[..., int]) -> Callable[..., int]:
    """megatron's ``get_num_layers_to_build``, but the stage's own layer count while one is being built."""

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> int:
        if STATE.stage_range is not None:
            start, end = STATE.stage_range
            return end - start
        return original(*args, **kwargs)

    return wrapper


def layer_offset(original: Callable[..., int]) -> Callable[..., int]:
    """megatron's ``get_transformer_layer_offset``, but the stage's first layer while one is built or
    while its model runs (layer numbers then stay global, whatever pipeline rank megatron sees)."""

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> int:
        if STATE.stage_range is not None:
            return STATE.stage_range[0]
        return original(*args, **kwargs)

    return wrapper


def tied_embedding_setup(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron's ``LanguageModule.setup_embeddings_and_output_layer`` for a stage being rebuilt with tied
    embeddings. Stock Megatron zero-fills the output layer's copy of the word embeddings on a last stage that is
    not also the first, and all-reduces it over the embedding group to copy the first stage's values; under our
    parallel_state every rank is pipeline stage 0 of 1 (0.14+ asserts the last stage is not also the first) and
    the values come from live copies instead (the restore after the rebuild). So only the parameter marks are
    set, as stock sets them for each kind of stage: the copy is ``shared`` (the gradient norm counts the pair
    once), and a stage holding both ends uses one weight twice (``zero_out_wgrad``)."""

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if STATE.stage_range is None or not getattr(self, "share_embeddings_and_output_weights", False):
            return original(self, *args, **kwargs)
        self.share_embeddings_and_output_weights = False  # the original then only marks embedding/output params
        try:
            original(self, *args, **kwargs)
        finally:
            self.share_embeddings_and_output_weights = True
        weight = self.shared_embedding_or_output_weight()
        if self.pre_process and self.post_process:
            weight.zero_out_wgrad = True
        elif self.pre_process:
            weight.shared_embedding = True
        elif self.post_process:
            weight.shared, weight.shared_embedding = True, True
        return None

    return wrapper


# -- gradient norm over a plan --------------------------------------------------------------------------

def grad_norm_fp32(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron's ``get_grad_norm_fp32`` as the optimizer calls it: the plan-wide norm Odyssey computed
    before the step's commit, so the optimizer runs no collective after it."""

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if STATE.grad_norm is not None:
            return STATE.grad_norm
        return original(*args, **kwargs)

    return wrapper


def rerun_check_waits_on_peers(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron's ``RerunStateMachine.should_run_forward_backward``, marked as communication: after each
    forward-backward it all-reduces over the world whether to run it again, so a rank there waits on every peer.
    Counted as its own work, a stage-0 rank waiting there for two data-parallel peers of the last stage that no
    longer reached each other (their gradient all-reduce stopped) was fenced instead of one of them."""
    from ..runtime.liveness import communicating

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with communicating():
            return original(*args, **kwargs)

    return wrapper


def loss_reduction_as_communication(out: Any, reduced_per_micro_batch: bool) -> Any:
    """A forward step's ``(output, loss function)``, the loss function's call marked as communication where the
    release's ``pretrain_gpt.py`` all-reduces each micro-batch's loss over the data-parallel group in it
    (``reduced_per_micro_batch``: the job config's ``loss_reduced_per_micro_batch``, core_r0.12): a rank waiting
    there on a stalled replica is waiting on a peer, not stalled itself (without it the agent fenced a last stage's
    healthy replica of a rank stalled in an evaluation, and lost the stage)."""
    from ..runtime.liveness import communicating

    if not (reduced_per_micro_batch and isinstance(out, tuple) and len(out) == 2 and callable(out[1])):
        return out
    output, loss_func = out

    @functools.wraps(loss_func)
    def reduced(*args: Any, **kwargs: Any) -> Any:
        with communicating():
            return loss_func(*args, **kwargs)

    return output, reduced


def zeros_counted_before_commit(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron's ``count_zeros_fp32`` as the optimizer calls it: inside a committed step the count made before
    the commit (``STATE.num_zeros``), with no collective after it. Only core_r0.12.0's ``ChainedOptimizer.step``
    counts without ``--log-num-zeros-in-grad`` (which --odyssey refuses), and ``train_step`` logs that count; its
    all-reduce after the commit had a survivor of a failure there retry the committed step until fenced."""

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if STATE.grad_norm is not None:
            return STATE.num_zeros if STATE.num_zeros is not None else 0
        return original(*args, **kwargs)

    return wrapper


# -- one gradient reduction per step (generation 0) ------------------------------------------------------

_REDUCED = "_odyssey_grads_reduced"


def _reduces_inside_backward_synchronously(bucket_group: Any) -> bool:
    """Megatron's bucket groups with --overlap-grad-reduce and --num-distributed-optimizer-instances > 1 reduce
    synchronously (on a side stream) and leave no handle behind: its own guard against a second dispatch
    (``grad_reduce_handle is not None``) never fires there."""
    ddp_config = bucket_group.ddp_config
    return bool(ddp_config.overlap_grad_reduce) and ddp_config.num_distributed_optimizer_instances > 1


def grad_sync_once(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron's ``_ParamAndGradBucketGroup.start_grad_sync``: with --overlap-grad-reduce and 2+ distributed-
    optimizer instances, stock Megatron-LM (core_r0.16.0 to main; core_r0.15.0 does not: its first step's grad norm
    equals the run without overlap; 0.12-0.14 not measured) reduces a step's gradients twice under pipeline
    parallelism: the backward hook (or, in the first step, ``finish_grad_sync``) and the schedule's
    ``grad_sync_func`` (--align-grad-reduce, the default) both start it. The second reduce-scatter runs over
    already-reduced shards and the step trains on other gradients (grad norm 1.110 against 1.326 at iteration 1
    of the tiny test job; with --no-align-grad-reduce or one instance, 1.326). Under --odyssey a bucket group's
    gradients are reduced once per step, as the plain optimizer and every later generation reduce them."""

    @functools.wraps(original)
    def start_grad_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        if STATE.runtime is None or not _reduces_inside_backward_synchronously(self):
            return original(self, *args, **kwargs)
        if getattr(self, _REDUCED, False):
            return None
        _communication_stream_after_the_callers(self)
        out = original(self, *args, **kwargs)
        setattr(self, _REDUCED, True)
        return out

    return start_grad_sync


def _communication_stream_after_the_callers(bucket_group: Any) -> None:
    """The bucket group's reduction stream waits for the stream the call comes from, not only the default one.

    core_r0.16.0 builds DDP under a side stream (``training.get_model``'s ``ddp_stream``), so torch (2.9+) runs
    the gradient-ready hooks - Megatron's ``main_grad.add_`` and this call - on that stream, while
    ``start_grad_sync`` makes its communication stream wait for the *default* stream only: the reduction can read a
    bucket before its last gradients are added (found on an H200: iteration 2's grad norm 2.767 against 1.725 when
    the hook, not the schedule, started the reduction). core_r0.17.0 on waits for ``torch.cuda.current_stream()``
    itself; this is that wait, a no-op there and on releases that build DDP on the default stream."""
    import torch

    stream = getattr(bucket_group, "communication_stream", None)
    if stream is None or not torch.cuda.is_available():  # (the CPU mode's streams keep no order: nothing to wait for)
        return
    stream.wait_stream(torch.cuda.current_stream())


def grad_sync_finished(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron's ``_ParamAndGradBucketGroup.finish_grad_sync``: unchanged; it ends the step's one reduction
    (:func:`grad_sync_once`)."""

    @functools.wraps(original)
    def finish_grad_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            self.__dict__.pop(_REDUCED, None)

    return finish_grad_sync


def stock_param_gather_only(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron's ``training.should_disable_forward_pre_hook`` and ``disable_forward_pre_hook``: with
    --overlap-param-gather, ``train()`` turns the model chunks' forward pre-hooks (which finish the deferred
    weight all-gather) off and on around saves and at its end, and forces the all-gather before a save.
    Rebuilt stages have no such hooks and nothing deferred (their weights are gathered right after each step:
    ``replica_optimizer``), and Megatron's DDP asserts on the calls; after the first failure they are no-ops."""

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        runtime = STATE.runtime
        if runtime is not None and not runtime.stock:
            return None
        return original(*args, **kwargs)

    return wrapper


# -- the diagnosis in Megatron's own schedule (generation 0) ---------------------------------------------

def _stock_recorder(name: str) -> Any:
    """The runtime's recorder ``name`` while Megatron's own schedule runs (before the first failure), else None."""
    runtime = STATE.runtime
    return getattr(runtime, name, None) if runtime is not None and runtime.stock else None


def timed_backward_step(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron's ``schedules.backward_step``: unchanged, but while Megatron's own schedule runs (before the
    first failure) timed for the agent's diagnosis and stretched by an injected slowdown, as our executor's
    backward operations are (``op_trace.ComputeTimer``)."""

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        timer = _stock_recorder("stock_timer")
        if timer is None:
            return original(*args, **kwargs)
        with timer.timing("backward"):
            return original(*args, **kwargs)

    return wrapper


def traced_p2p(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron's ``_communicate`` (a function of ``p2p_communication`` to 0.13, ``P2PCommunicator``'s method
    from 0.14): unchanged, but while Megatron's own schedule runs its messages are noted for the diagnosis'
    link matrix, and held back by an injected slow link (``stock_trace.StockMessages``); a rank blocked in it
    waits on a peer (``liveness.communicating``: the agent then blames the peer that stopped, not the waiter)."""
    from ..runtime.liveness import communicating

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        log = _stock_recorder("stock_messages")
        if log is None:
            with communicating():
                return original(*args, **kwargs)
        log.sending(kwargs)
        entered = time.time()
        with communicating():
            out = original(*args, **kwargs)
        posted = log.received_all(kwargs, entered, time.time(), waited=kwargs.get("wait_on_reqs", True))
        requests = out[2] if isinstance(out, tuple) and len(out) == 3 else None
        if posted and isinstance(requests, dict):  # overlapped receives: timed when the schedule waits for them
            from .stock_trace import TimedReceive

            for key, (node, name) in posted.items():
                if key in requests:
                    requests[key] = TimedReceive(requests[key], log.trace, node, name)
        return out

    return wrapper


# -- capturing Megatron's set-up ------------------------------------------------------------------------

def whole_batch_on_every_stage(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron's ``get_batch_on_this_tp_rank``: tensor-parallel rank 0 reads the batch and broadcasts to the
    others what its pipeline stage needs (tokens on the first stage, labels on the last), deciding by the
    pipeline size (0.12-0.17: ``args.pipeline_model_parallel_size``; 0.18+: an argument) and the stage. After
    a failure every rank is stage 0 of 1 to Megatron (the executor does the pipelining; a plan's stage may be
    both), so the split would drop the labels on every rank but TP rank 0: read the whole batch, as without
    pipelining."""

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        runtime = STATE.runtime
        if runtime is None or runtime.sync is None:
            return original(*args, **kwargs)
        if "pipeline_model_parallel_size" in kwargs:  # 0.18+
            kwargs["pipeline_model_parallel_size"] = 1
            return original(*args, **kwargs)
        from megatron.training.global_vars import get_args

        with overridden(get_args(), pipeline_model_parallel_size=1):  # 0.12-0.17
            return original(*args, **kwargs)

    return wrapper


def capture_get_model(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron's ``get_model``: unchanged, but remembers the model provider and type for rebuilds."""

    @functools.wraps(original)
    def wrapper(model_provider_func: Callable[..., Any], model_type: Any = None, *args: Any, **kwargs: Any) -> Any:
        if STATE.captured.model_provider is None:
            STATE.captured.model_provider, STATE.captured.model_type = model_provider_func, model_type
        if model_type is None:
            return original(model_provider_func, *args, **kwargs)
        return original(model_provider_func, model_type, *args, **kwargs)

    return wrapper


def capture_model_builder(original: Callable[..., Any]) -> Callable[..., Any]:
    """0.19+: ``pretrain`` builds models from a config container through ``GPTModelBuilder`` and never
    calls ``get_model``; remember a provider over the builder's ``build_model`` (one stage, any
    pre/post-processing) so a rebuild can still go through Megatron's ``get_model``."""

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if STATE.captured.model_provider is None:
            from megatron.core.enums import ModelType

            def provider(pre_process: bool = True, post_process: bool = True, vp_stage: Any = None,
                         config: Any = None, pg_collection: Any = None, **_: Any) -> Any:
                return self.build_model(pg_collection, pre_process=pre_process, post_process=post_process,
                                        vp_stage=vp_stage)

            STATE.captured.model_provider = provider
            STATE.captured.model_type = kwargs.get("model_type", ModelType.encoder_or_decoder)
        return original(self, *args, **kwargs)

    return wrapper


def capture_get_optimizer(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron's ``get_megatron_optimizer``: unchanged, but remembers its arguments (they differ
    between megatron-core 0.12 and 0.16) so a rebuilt stage gets an identical optimizer."""

    @functools.wraps(original)
    def wrapper(config: Any, model_chunks: Any, *args: Any, **kwargs: Any) -> Any:
        STATE.captured.optimizer_call = ((config, *args), dict(kwargs))
        return original(config, model_chunks, *args, **kwargs)

    return wrapper


def build_datasets_everywhere(original: Callable[..., Any]) -> Callable[..., Any]:
    """``BlendedMegatronDatasetBuilder.__init__``: with Odyssey on, every rank builds the datasets
    (stock Megatron builds them on first/last pipeline stages only), because a failure can turn any
    rank into a first or last stage; also keeps the training split for (step, micro-batch) access."""

    @functools.wraps(original)
    def wrapper(self: Any, cls: Any, sizes: Any, is_built_on_rank: Callable[[], bool], config: Any, *a: Any, **k: Any) -> None:
        if odyssey_enabled():
            is_built_on_rank = _always
        original(self, cls, sizes, is_built_on_rank, config, *a, **k)

    return wrapper


def _always() -> bool:
    return True


def capture_datasets(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron's ``build_train_valid_test_datasets``: unchanged, but keeps the splits (0.16+ may give a list
    of validation splits: one, unless --multiple-validation-sets, which --odyssey refuses)."""

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        valid = out[1][0] if isinstance(out[1], list) and len(out[1]) == 1 else out[1]
        STATE.captured.train_ds, STATE.captured.valid_ds, STATE.captured.test_ds = out[0], valid, out[2]
        return out

    return wrapper


def odyssey_enabled() -> bool:
    """True when Megatron's parsed arguments ask for Odyssey (False before parsing or without Megatron-LM)."""
    try:
        from megatron.training.global_vars import get_args

        return bool(getattr(get_args(), "odyssey", False))
    except Exception:  # no Megatron-LM on the path, or arguments not parsed yet
        return False


# -- checkpoints after a recovery (see megatron_lm.checkpoint) -----------------------------------------

def _recovered_runtime() -> Any:
    """This rank's runtime once it runs an Odyssey plan (after the first failure), else None."""
    runtime = STATE.runtime
    return runtime if runtime is not None and not runtime.stock else None


def plan_replica_state_dict(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron's ``generate_state_dict``: after a recovery each model chunk's sharded state dict marks
    replicas by the plan (one writer per unit), and the optimizer's, built from it, follows."""

    @functools.wraps(original)
    def wrapper(args: Any, model: Any, *a: Any, **k: Any) -> Any:
        runtime = _recovered_runtime()
        if runtime is None or getattr(args, "ckpt_format", "torch_dist") != "torch_dist":
            return original(args, model, *a, **k)
        from .checkpoint import with_plan_replicas

        for chunk in model:
            chunk.sharded_state_dict = with_plan_replicas(chunk, runtime)
        try:
            return original(args, model, *a, **k)
        finally:
            for chunk in model:
                chunk.__dict__.pop("sharded_state_dict", None)

    return wrapper


def original_layout_rerun_state(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron-core's ``RerunStateMachine.state_dict``: after a recovery, its per-rank entry in the launch's
    layout (``checkpoint.original_layout_rerun_state``); a load is ``force=True`` (0.19+) or an in-process restart's
    (``MegatronRank.loading_checkpoint``: before 0.19 the load asks like a save)."""

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        runtime = _recovered_runtime()
        if runtime is None:
            return out
        from .checkpoint import original_layout_rerun_state

        loading = bool(kwargs.get("force", False)) or getattr(runtime, "loading_checkpoint", False)
        return original_layout_rerun_state(out, runtime, loading=loading)

    return wrapper


def own_rerun_state(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron-core's ``RerunStateMachine.load_state_dict``: loads this rank's slot of the entry that
    ``original_layout_rerun_state`` asked for (``checkpoint.own_rerun_state``)."""

    @functools.wraps(original)
    def wrapper(self: Any, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        from .checkpoint import own_rerun_state

        return original(self, own_rerun_state(state_dict), *args, **kwargs)

    return wrapper


def original_layout_rng_state(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron's ``get_rng_state``: after a recovery, the RNG slots of the original (stage x TP) layout
    this rank writes, instead of slot (0, tp) that every rank would claim under our parallel_state."""

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        runtime = _recovered_runtime()
        if runtime is None or isinstance(out, (list, dict)):  # legacy formats keep a plain list
            return out
        from .checkpoint import original_layout_rng

        return original_layout_rng(out, runtime)

    return wrapper
