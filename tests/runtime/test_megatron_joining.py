"""A Megatron-LM rank of a machine that comes back (megatron_lm.joining), the parts that need no Megatron-LM:
its command line checked against the running job's, its private layout, the job's view for the --odyssey-*
checks, and Megatron's loop put where the job is (the whole join, with Megatron-LM, is in test_megatron_lm.py).
The job is a real TCPStore holding the config its rank 0 publishes; the scheduler is megatron-core's."""
from __future__ import annotations

import argparse
import json
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron_odyssey.arguments import OdysseyArgumentError, validate_odyssey_args
from megatron_odyssey.launch import CONFIG_KEY
from megatron_odyssey.megatron_lm import joining
from megatron_odyssey.megatron_lm.hooks import STATE, reset_state
from megatron_odyssey.runtime.config import TrainConfig
from megatron_odyssey.runtime.control_plane import free_port

JOB = dict(nproc=8, tp=2, pp=2, layers=8, hidden=64, heads=4, seq=32, global_batch=16, micro_batch=2, steps=20, seed=7)


@pytest.fixture
def job(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """The running job's store; ``@pytest.mark.parametrize("job", [extra], indirect=True)`` adds config extras."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    store.set(CONFIG_KEY, json.dumps(TrainConfig(**JOB, extra=getattr(request, "param", {})).__dict__))
    monkeypatch.setenv("ODYSSEY_STORE", f"127.0.0.1:{port}")
    monkeypatch.setenv(joining.JOIN_RANK_ENV, "5")
    joining.job_config.cache_clear()
    reset_state()
    yield store
    joining.job_config.cache_clear()
    reset_state()
    from megatron.core import num_microbatches_calculator

    num_microbatches_calculator.destroy_num_microbatches_calculator()  # (resume_where_the_job_is sets it up)


def _args(**changes) -> argparse.Namespace:
    """The job's command line as Megatron parsed it on a joining rank (world size: its private world)."""
    from megatron_odyssey.arguments import add_odyssey_args

    args = add_odyssey_args(argparse.ArgumentParser()).parse_args(
        ["--odyssey", "--odyssey-policy", "reroute", "--odyssey-inject-fault", "step=3,rank=6,kind=kill"])
    values = dict(num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                  global_batch_size=16, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, train_iters=20,
                  seed=7, world_size=2, data_parallel_size=1, virtual_pipeline_model_parallel_size=2,
                  num_layers_per_virtual_pipeline_stage=2, load="/ckpt", iteration=0, consumed_train_samples=0, rank=0)
    values.update(changes)
    vars(args).update(values)
    return args


def test_the_join_rank_comes_from_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(joining.JOIN_RANK_ENV, raising=False)
    assert joining.join_rank() is None
    monkeypatch.setenv(joining.JOIN_RANK_ENV, "12")
    assert joining.join_rank() == 12


def test_a_joining_rank_sets_up_one_stage_of_one_layer_and_loads_nothing(job) -> None:
    args = _args()
    joining.private_layout(args)
    assert args.pipeline_model_parallel_size == 1 and args.load is None
    assert args.virtual_pipeline_model_parallel_size is None and args.num_layers_per_virtual_pipeline_stage is None
    assert STATE.stage_range == (0, 1)  # embedding, one layer, output: the admitted stage is built later
    assert STATE.joining == {"load": "/ckpt", "writers": {"tensorboard_dir": None, "wandb_project": None}}


@pytest.mark.parametrize("attr, flag, value", [("num_layers", "--num-layers", 16), ("global_batch_size",
                                               "--global-batch-size", 32), ("seed", "--seed", 8)])
def test_a_command_line_that_is_not_the_jobs_is_refused(job, attr: str, flag: str, value: int) -> None:
    with pytest.raises(OdysseyArgumentError, match=f"{flag} {value} differs from the running job's"):
        joining.private_layout(_args(**{attr: value}))


def test_a_machine_joins_an_fp16_job(job) -> None:
    """Its loss scale and schedule step count are handed over when it enters (loss_scale.hand_over)."""
    joining.private_layout(_args(fp16=True, accumulate_allreduce_grads_in_fp32=True))
    assert STATE.joining["load"] == "/ckpt"


def test_odyssey_flags_are_checked_against_the_jobs_world(job) -> None:
    """--odyssey-inject-fault names rank 6 and --odyssey-policy reroute needs data-parallel peers: true of the
    job (8 ranks, DP 2), not of the private world (2 ranks, DP 1), which comes back afterwards."""
    args = _args()
    joining.private_layout(args)
    with pytest.raises(OdysseyArgumentError):
        validate_odyssey_args(args)
    with joining.as_the_job(args):
        validate_odyssey_args(args)
    assert (args.world_size, args.data_parallel_size, args.pipeline_model_parallel_size) == (2, 1, 1)


def test_megatrons_loop_resumes_at_the_jobs_iteration_and_learning_rate(job) -> None:
    """Admitted at iteration 7: the job's layout in args, Megatron's counters, and a learning rate equal to a
    scheduler that stepped the global batch through iterations 0..6 (as the job's ranks' did)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    def scheduler() -> OptimizerParamScheduler:
        opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
        return OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=32,
                                       lr_decay_steps=320, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                       wd_incr_steps=320, wd_incr_style="constant")

    reference = scheduler()
    for _ in range(7):
        reference.step(increment=16)
    args, joined = _args(tensorboard_dir="/tb", wandb_project="llama"), scheduler()
    joining.private_layout(args)
    # Megatron opens its TensorBoard and W&B writers on the world's last rank, which the private world makes this
    # rank: their flags are withheld there, and given back with the job's layout (log_writers)
    assert args.tensorboard_dir is None and args.wandb_project is None
    joining.resume_where_the_job_is(args, joined, ident=5, resume=7)
    assert (args.tensorboard_dir, args.wandb_project) == ("/tb", "llama")
    assert (args.world_size, args.data_parallel_size, args.pipeline_model_parallel_size) == (8, 2, 2)
    assert (args.rank, args.load, args.iteration, args.consumed_train_samples) == (5, "/ckpt", 7, 112)
    assert joined.num_steps == reference.num_steps == 112
    assert joined.optimizer.param_groups[0]["lr"] == reference.optimizer.param_groups[0]["lr"] > 0
    # the micro-batch calculator of the job's DP (2), not of the private world's (1): train() logs 16 as the batch
    from megatron.core.num_microbatches_calculator import get_current_global_batch_size, get_num_microbatches

    assert (get_num_microbatches(), get_current_global_batch_size()) == (4, 16)


@pytest.mark.parametrize("job", [{"batch_ramp": [5, 28, 16]}], indirect=True)
def test_past_a_batch_size_ramp_the_loop_resumes_at_the_samples_megatron_consumed(job) -> None:
    """The job ramped its batch and reached 16 at iteration 6 (step 5) after 28 samples: admitted at iteration 7,
    Megatron's counters say 28 + 2 x 16 = 60 samples, not 7 x 16 (megatron_lm.batch_ramp)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    joined = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=32,
                                     lr_decay_steps=320, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                     wd_incr_steps=320, wd_incr_style="constant")
    args = _args()
    joining.private_layout(args)
    joining.resume_where_the_job_is(args, joined, ident=5, resume=7)
    assert (args.iteration, args.consumed_train_samples, joined.num_steps) == (7, 60, 60)


@pytest.mark.parametrize("job", [{"step_batch_size_schedule": "0:8 64:16"}], indirect=True)
def test_a_step_batch_size_schedule_is_checked_instead_of_the_global_batch(job) -> None:
    """With --step-batch-size-schedule (core_r0.18 on) no --global-batch-size is given (Megatron sets it to
    micro-batch x DP later): the joining rank's schedule must be the job's."""
    joining.private_layout(_args(global_batch_size=None, step_batch_size_schedule="0:8 64:16"))
    with pytest.raises(OdysseyArgumentError, match="--step-batch-size-schedule 0:8 32:16 differs from the running "
                                                   "job's 0:8 64:16"):
        joining.private_layout(_args(global_batch_size=None, step_batch_size_schedule="0:8 32:16"))
    with pytest.raises(OdysseyArgumentError, match="--step-batch-size-schedule None differs"):
        joining.private_layout(_args())
