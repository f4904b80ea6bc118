"""A machine that comes back to a running Megatron-LM job (``odyssey-launch --join HOST:PORT``).

Its ranks run the job's own ``pretrain_gpt.py`` command line, but they cannot enter the job through
Megatron's start-up: the job's world is a later generation of Odyssey's by now, and its ranks are inside
iterations. So each joining node (its tensor-parallel ranks) starts Megatron in a private world of its
own (the launcher gives it torchrun's variables for a world of TP ranks), in which :func:`private_layout`,
run before Megatron's ``validate_args``, makes the pipeline one stage, builds one transformer layer (the
admitted stage is built later, and its state comes from live replicas) and loads no checkpoint. Megatron
then sets up everything else as usual: tokenizer, datasets, optimizer, scheduler, the objects ``train()``
will hold. Just before ``train()`` (:func:`join_before_train`), the rank asks the agent to join and waits
until the planner admits it (``runtime.joining``); Megatron's loop is then put where the job is (its
iteration, consumed samples, learning-rate schedule, micro-batch calculator, and the job's layout in ``args``;
a --fp16 job's loss scale follows as the generation is entered, ``loss_scale.hand_over``), and its first
``train_step`` leaves the private world and enters the admitted generation (``MegatronRank``), after which
it is a rank like the others.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, ContextManager

from . import log_writers
from .hooks import STATE, odyssey_enabled, overridden

JOIN_RANK_ENV = "ODYSSEY_JOIN_RANK"  # the global rank a joining process takes (set by odyssey-launch --join)

# Megatron arguments a joining rank must share with the job (its flag, the job config's field)
_SAME_AS_JOB = (("num_layers", "--num-layers", "layers"), ("hidden_size", "--hidden-size", "hidden"),
                ("num_attention_heads", "--num-attention-heads", "heads"), ("seq_length", "--seq-length", "seq"),
                ("micro_batch_size", "--micro-batch-size", "micro_batch"),
                ("global_batch_size", "--global-batch-size", "global_batch"),
                ("tensor_model_parallel_size", "--tensor-model-parallel-size", "tp"),
                ("pipeline_model_parallel_size", "--pipeline-model-parallel-size", "pp"),
                ("train_iters", "--train-iters", "steps"), ("seed", "--seed", "seed"))
# what a pipeline of one stage must not have (interleaving, uneven first/last stages)
_PIPELINE_SHAPE = ("virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
                   "num_virtual_stages_per_pipeline_rank", "decoder_first_pipeline_num_layers",
                   "decoder_last_pipeline_num_layers", "pipeline_model_parallel_layout")


def join_rank() -> int | None:
    """The global rank this process joins a running job as, or None (a rank launched with the job)."""
    value = os.environ.get(JOIN_RANK_ENV, "")
    return int(value) if value else None


@functools.lru_cache(maxsize=1)
def job_config() -> Any:
    """The running job's TrainConfig, from its agent's store (published by rank 0 when training began)."""
    from ..runtime.control_plane import client
    from ..runtime.joining import read_job_config

    host, port = os.environ["ODYSSEY_STORE"].rsplit(":", 1)
    return read_job_config(client((host, int(port)), 60))


def private_layout(args: Any) -> None:
    """Before Megatron's ``validate_args`` on a joining rank: refuse a command line that is not the job's,
    then make the private world's layout (one pipeline stage of one layer, no checkpoint to load)."""
    from ..arguments import OdysseyArgumentError

    cfg = job_config()
    checks = [(getattr(args, attr, None), flag, getattr(cfg, field)) for attr, flag, field in _SAME_AS_JOB]
    schedule = cfg.extra.get("step_batch_size_schedule")
    if schedule is not None or getattr(args, "step_batch_size_schedule", None) is not None:
        # (its --global-batch-size is not given: Megatron sets it to micro-batch x DP; the schedule is the batch)
        checks = [c for c in checks if c[1] != "--global-batch-size"]
        checks.append((getattr(args, "step_batch_size_schedule", None), "--step-batch-size-schedule", schedule))
    for mine, flag, theirs in checks:
        if mine != theirs:
            raise OdysseyArgumentError(f"odyssey-launch --join: {flag} {mine} differs from the running job's "
                                       f"{theirs}; join with the job's own command line")
    STATE.joining = {"load": getattr(args, "load", None), "writers": log_writers.withhold(args)}
    args.pipeline_model_parallel_size = 1
    for name in _PIPELINE_SHAPE:
        if getattr(args, name, None) is not None:
            setattr(args, name, None)
    args.load = None
    STATE.stage_range = (0, 1)  # the private model: embedding, one layer, output (get_model, see hooks)


def as_the_job(args: Any) -> ContextManager[None]:
    """``args`` as the running job has them (world, data-parallel and pipeline sizes), for the checks of
    ``--odyssey-*`` flags that name ranks and peers; the private layout again afterwards."""
    cfg = job_config()
    return overridden(args, world_size=cfg.nproc, data_parallel_size=cfg.dp, pipeline_model_parallel_size=cfg.pp)


def resume_where_the_job_is(args: Any, scheduler: Any, ident: int, resume: int) -> None:
    """After admission, before ``train()`` reads them: the job's layout and Megatron's loop counters at
    iteration ``resume``. The learning-rate schedule is a function of the samples consumed: every committed
    iteration stepped it by its global batch (in a --fp16 job skipped iterations do not: there the step count, and
    the loss scale, come from a rank that trained when the admitted generation is entered, ``loss_scale.hand_over``;
    a batch-size ramp is over before anyone joins: a failure inside it stops the job, ``batch_ramp``)."""
    from .batch_ramp import BatchRamp

    cfg = job_config()
    args.pipeline_model_parallel_size, args.world_size, args.data_parallel_size = cfg.pp, cfg.nproc, cfg.dp
    args.rank, args.load = ident, (STATE.joining or {}).get("load")
    log_writers.give_back(args, (STATE.joining or {}).get("writers", {}))
    _micro_batches_of_the_job(args, cfg)
    ramp = BatchRamp.from_list(cfg.extra.get("batch_ramp"))
    consumed = ramp.samples_before(resume) if ramp else resume * cfg.global_batch
    args.iteration, args.consumed_train_samples = resume, consumed
    scheduler.step(increment=consumed - int(getattr(scheduler, "num_steps", 0)))


def _micro_batches_of_the_job(args: Any, cfg: Any) -> None:
    """Megatron's micro-batch calculator, set up in the private world (data-parallel size 1), for the job's
    data-parallel size: ``train()`` derives the global batch it logs and the samples it counts from it. With a
    step batch-size schedule Megatron's --global-batch-size is micro-batch x DP, as on the job's ranks."""
    import inspect

    from megatron.core import num_microbatches_calculator as calculator

    if getattr(args, "step_batch_size_schedule", None) is not None:
        args.global_batch_size = args.micro_batch_size * cfg.dp
    given = dict(rank=args.rank, rampup_batch_size=getattr(args, "rampup_batch_size", None),
                 global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
                 data_parallel_size=cfg.dp * int(getattr(args, "gtp_weight_remat_size", None) or 1),
                 decrease_batch_size_if_needed=bool(getattr(args, "decrease_batch_size_if_needed", False)),
                 step_batch_size_schedule=getattr(args, "step_batch_size_schedule", None),
                 seq_length=getattr(args, "seq_length", None))
    accepted = inspect.signature(calculator.reconfigure_num_microbatches_calculator).parameters
    calculator.reconfigure_num_microbatches_calculator(**{k: v for k, v in given.items() if k in accepted})


def join_before_train(original: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron's ``train``: on a joining rank, first wait for admission and put the loop where the job is."""

    @functools.wraps(original)
    def train(forward_step_func: Any, model: list, optimizer: Any, opt_param_scheduler: Any, *args: Any,
              **kwargs: Any) -> Any:
        if join_rank() is not None and odyssey_enabled():
            from megatron.training.global_vars import get_args

            from .rank import MegatronRank

            STATE.runtime = MegatronRank(get_args(), model, optimizer, opt_param_scheduler, joining=True)
            STATE.runtime.await_admission()
        return original(forward_step_func, model, optimizer, opt_param_scheduler, *args, **kwargs)

    return train
