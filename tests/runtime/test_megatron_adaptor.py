"""The Megatron-LM adaptor with the megatron-core wheel only: patch registry, flags, dispatcher, stage
ranges and the plan-wide gradient norm. (The run through Megatron-LM's own pretrain_gpt.py is in
test_megatron_lm.py and needs a checkout.)"""
from __future__ import annotations

import argparse
import importlib
import sys
import types
from typing import Any

import pytest
import torch

from megatron_odyssey import megatron_adaptor as adaptor
from megatron_odyssey.arguments import OdysseyArgumentError, add_odyssey_args, validate_odyssey_args
from megatron_odyssey.planning.plan import symmetric_plan
from megatron_odyssey.planning.planner import reroute_plan
from megatron_odyssey.planning.schedule import node_operations
from megatron_odyssey.megatron_lm.hooks import STATE, reset_state


def _resolve(target: str):
    module, path = target.split(":")
    owner = importlib.import_module(module)
    for name in path.split(".")[:-1]:
        owner = getattr(owner, name)
    return owner, path.split(".")[-1]


@pytest.fixture(autouse=True)
def _clean_state():
    reset_state()
    yield
    reset_state()
    adaptor.apply_patches()  # leave the process as the import left it


# -- registry ---------------------------------------------------------------------------------------------

def test_every_patch_names_megatron_target_and_reason() -> None:
    targets = [p.target for p in adaptor.PATCHES]
    assert len(targets) == len(set(targets))
    for p in adaptor.PATCHES:
        assert p.target.startswith("megatron.") and ":" in p.target
        assert len(p.why) > 20


def test_apply_and_remove_are_idempotent_and_restore_originals() -> None:
    from megatron_odyssey.megatron_lm.versions import installed_version

    adaptor.remove_patches()
    minor = installed_version().minor
    applicable = [p for p in adaptor.PATCHES
                  if p.expected_in(minor) and importlib.util.find_spec(p.module.split(".")[0]) is not None]
    originals = {}
    for p in applicable:
        try:
            owner, attr = _resolve(p.target)
        except ModuleNotFoundError:
            continue
        originals[p.target] = getattr(owner, attr)
    assert originals, "the wheel must offer some targets (megatron.core)"
    status = adaptor.apply_patches()
    again = adaptor.apply_patches()
    assert status == again
    for target, original in originals.items():
        assert status[target] == "applied"
        owner, attr = _resolve(target)
        patched = getattr(owner, attr)
        assert patched is not original
        assert getattr(patched, adaptor.ORIGINAL_ATTR) is original  # wrapped once, never twice
    for p in applicable:
        if p.target not in originals:
            assert "megatron.training" in status[p.target] or "No module" in status[p.target]
    adaptor.remove_patches()
    adaptor.remove_patches()
    for target, original in originals.items():
        owner, attr = _resolve(target)
        assert getattr(owner, attr) is original
    assert set(adaptor.patch_status().values()) == {"not applied"}


# -- flags ------------------------------------------------------------------------------------------------

def _megatron_like_args(argv: list[str], **megatron: object) -> argparse.Namespace:
    parser = add_odyssey_args(argparse.ArgumentParser())
    add_odyssey_args(parser)  # a second call adds nothing
    ns = parser.parse_args(argv)
    defaults = dict(world_size=8, data_parallel_size=2, train_iters=10, use_distributed_optimizer=False,
                    overlap_grad_reduce=False, overlap_param_gather=False, fp16=False, bf16=False,
                    virtual_pipeline_model_parallel_size=None, context_parallel_size=1,
                    expert_model_parallel_size=1, num_experts=None, barrier_with_L1_time=True)
    defaults.update(megatron)
    for k, v in defaults.items():
        setattr(ns, k, v)
    return ns


def test_flags_parse() -> None:
    ns = _megatron_like_args(["--odyssey", "--odyssey-policy", "reroute", "--odyssey-max-cached-failures", "2",
                              "--odyssey-mtbf-hours", "1000", "--odyssey-heartbeat-timeout", "10",
                              "--odyssey-profile-iters", "3", "--odyssey-report", "r.json",
                              "--odyssey-inject-fault", "step=3,rank=5,phase=backward,kind=kill",
                              "--odyssey-inject-fault", "step=6,rank=1"])
    validate_odyssey_args(ns)
    assert (ns.odyssey, ns.odyssey_policy, ns.odyssey_max_cached_failures) == (True, "reroute", 2)
    assert ns.odyssey_mtbf_hours == 1000 and ns.odyssey_heartbeat_timeout == 10 and ns.odyssey_profile_iters == 3
    assert ns.odyssey_inject_fault == ["step=3,rank=5,phase=backward,kind=kill", "step=6,rank=1"]
    assert ns.barrier_with_L1_time is False  # world barriers in timers would hang after a failure


@pytest.mark.parametrize("policy", ["sometimes", "stagger"])
def test_bad_policy_is_rejected_by_argparse(capsys: pytest.CaptureFixture, policy: str) -> None:
    """``stagger`` too: a Megatron-LM job's update clips by the whole model's gradient norm, so its ranks cannot
    update ahead of the commit (and the planner, told so by TrainConfig.stagger, never offers it)."""
    with pytest.raises(SystemExit):
        _megatron_like_args(["--odyssey", "--odyssey-policy", policy])
    assert "invalid choice" in capsys.readouterr().err
    from megatron_odyssey.planning.errors import PlanningError
    from megatron_odyssey.runtime.config import TrainConfig

    with pytest.raises(PlanningError, match="does not run the staggered optimizer"):
        TrainConfig(policy="stagger", stagger=False).validate()


def test_where_megatrons_loop_ends_counts_exit_interval_from_iteration_0() -> None:
    """--train-iters 10 --exit-interval 4: Megatron's check after iteration i ends the loop where i % 4 == 0 or
    i == 10, i.e. after 0-based steps 3, 7 and 9. A job resumed at iteration 5 ends after step 7, not 5 + 4 - 1
    (the agent asks per step, argument checks at start-up from iteration 0)."""
    from megatron_odyssey.arguments import ends_after, last_step_from

    assert [s for s in range(10) if ends_after(s, 10, 4)] == [3, 7, 9]
    assert [s for s in range(10) if ends_after(s, 10, None)] == [9]
    assert [last_step_from(start, 10, 4) for start in (0, 3, 4, 5, 8, 9)] == [3, 3, 7, 7, 9, 9]
    assert last_step_from(5, 10, None) == 9 and last_step_from(0, 3, 4) == 2


@pytest.mark.parametrize("argv, megatron, message", [
    (["--odyssey"], {"use_distributed_optimizer": True}, "--num-distributed-optimizer-instances 2"),
    (["--odyssey"], {"fp16": True, "calculate_per_token_loss": True, "accumulate_allreduce_grads_in_fp32": True},
     "--fp16 and --calculate-per-token-loss"),
    (["--odyssey"], {"fp16": True}, "--odyssey needs --accumulate-allreduce-grads-in-fp32 with --fp16"),
    (["--odyssey"], {"context_parallel_size": 2}, "--context-parallel-size"),
    (["--odyssey"], {"num_experts": 8}, "MoE"),
    (["--odyssey"], {"mtp_num_layers": 1}, "--mtp-num-layers 1 .multi-token prediction.: its layers sit on the last stage"),
    (["--odyssey"], {"inprocess_restart": True}, "--inprocess-restart: nvidia-resiliency-ext's in-process restart"),
    (["--odyssey"], {"enable_ft_package": True}, "--enable-ft-package"),
    (["--odyssey"], {"log_straggler": True}, "--log-straggler"),
    (["--odyssey"], {"check_weight_hash_across_dp_replicas_interval": 100},
     "--check-weight-hash-across-dp-replicas-interval: it compares weight hashes"),
    (["--odyssey"], {"gpu_sniff_test_interval": 100}, "--gpu-sniff-test-interval: Megatron-LM's GPU sniff test"),
    (["--odyssey"], {"fp8": "hybrid"}, "--fp8-format: low-precision training keeps each layer's scaling state"),
    (["--odyssey"], {"fp4": "e2m1"}, "--fp4-format: low-precision training"),
    (["--odyssey", "--odyssey-inject-fault", "step=1,rank=1,phase=end"], {}, "phase=end fires once, after the last "
     "iteration: give step=9"),
    (["--odyssey", "--odyssey-inject-fault", "step=9,rank=1,phase=end"], {"exit_interval": 4},
     "phase=end fires once, after the last iteration: give step=3"),
    (["--odyssey"], {"tensor_parallel_num_weight_shards": 2}, "--tensor-parallel-num-weight-shards 2"),
    (["--odyssey"], {"dataloader_type": "external"}, "--dataloader-type external is the script's own data loader"),
    (["--odyssey"], {"save": "/ckpt", "ckpt_format": "torch"}, "--ckpt-format torch writes one file per pipeline rank"),
    (["--odyssey"], {"async_save": True}, "--async-save"),
    (["--odyssey"], {"non_persistent_ckpt_type": "local"}, "--non-persistent-ckpt-type local: nvidia-resiliency-ext"),
    (["--odyssey"], {"log_num_zeros_in_grad": True}, "--log-num-zeros-in-grad"),
    (["--odyssey"], {"eval_iters": 100, "full_validation": True}, "--full-validation: it reads the whole"),
    (["--odyssey"], {"eval_iters": 100, "step_batch_size_schedule": "0:8 1000:16"},
     "cannot evaluate with --step-batch-size-schedule"),
    (["--odyssey"], {"eval_iters": 100, "multiple_validation_sets": True}, "--multiple-validation-sets"),
    (["--odyssey"], {"eval_iters": 100, "global_batch_size": 8, "eval_global_batch_size": 64},
     "--eval-global-batch-size 64 differs from --global-batch-size"),
    (["--odyssey-policy", "reroute"], {}, "without --odyssey"),
    (["--odyssey", "--odyssey-heartbeat-timeout", "0"], {}, "heartbeat"),
    (["--odyssey", "--odyssey-max-cached-failures", "-1"], {}, "max-cached"),
    (["--odyssey", "--odyssey-inject-fault", "step=3"], {}, "missing rank"),
    (["--odyssey", "--odyssey-inject-fault", "step=3,rank=8"], {}, "does not exist"),
    (["--odyssey", "--odyssey-inject-fault", "step=10,rank=1"], {}, "--train-iters"),
    (["--odyssey", "--odyssey-inject-fault", "step=1,rank=1,phase=lunch"], {}, "phase must be"),
    (["--odyssey", "--odyssey-policy", "reroute"], {"data_parallel_size": 1}, "data-parallel size is 1"),
    (["--odyssey", "--odyssey-rejoin", "3"], {}, "--odyssey-rejoin '3': expected RANK@STEP"),
    (["--odyssey", "--odyssey-rejoin", "8@1"], {}, "the rank must be one of the job's 0..7"),
])
def test_invalid_combinations_fail_clearly(argv: list[str], megatron: dict, message: str) -> None:
    ns = _megatron_like_args(argv, **megatron)
    with pytest.raises(OdysseyArgumentError, match=message.replace("-", r"\-")):
        validate_odyssey_args(ns)


def test_a_save_without_psutil_is_refused_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """On core_r0.13-0.16 each torch_dist writer process asks psutil for its memory before its error handling:
    without psutil every writer dies at its start and Megatron waits for them forever at the first save (seen here:
    a fresh environment's checkpoint test hung; 0.12 fails there on the import; from 0.17 on the writers are threads
    and the save fails: run with core_r0.17.0's and core_r0.19.0's own megatron.core, psutil hidden). --odyssey says
    so at start-up instead, naming psutil and --save."""
    from megatron_odyssey.megatron_lm.versions import stock_save_blocker

    monkeypatch.setitem(sys.modules, "psutil", None)  # as if not installed (import raises)
    assert "psutil" in stock_save_blocker(13) and "waits for them forever" in stock_save_blocker(16)
    assert "in the rank's own thread, and the first save fails" in stock_save_blocker(20)
    assert "imports it at the first save" in stock_save_blocker(12)  # 0.12: an ImportError there, every step lost
    with pytest.raises(OdysseyArgumentError, match=r"\-\-save cannot work in this environment: .*pip install psutil"):
        validate_odyssey_args(_megatron_like_args(["--odyssey"], save="/ckpt"))
    validate_odyssey_args(_megatron_like_args(["--odyssey"]))  # no --save: nothing asked
    monkeypatch.setitem(sys.modules, "psutil", types.ModuleType("psutil"))  # installed
    assert "psutil" not in (stock_save_blocker(16) or "")


@pytest.mark.parametrize("flag, value", [("fault_injector_ranks", "1"), ("fault_injector_num_ranks", 2)])
def test_megatron_fault_injector_without_its_library_is_refused_naming_the_flag(
        monkeypatch: pytest.MonkeyPatch, flag: str, value: Any) -> None:
    """Megatron's --fault-injector-* imports nvidia_resiliency_ext.shared_utils.inject_fault (0.6+) only at train()'s
    start, on every rank: without it, --odyssey says so before any process group exists."""
    monkeypatch.setitem(sys.modules, "nvidia_resiliency_ext", None)  # as if not installed (import raises)
    with pytest.raises(OdysseyArgumentError, match=f"--{flag.replace('_', '-')} needs nvidia-resiliency-ext 0.6"):
        validate_odyssey_args(_megatron_like_args(["--odyssey"], **{flag: value}))
    validate_odyssey_args(_megatron_like_args(["--odyssey"]))  # no injector flag: nothing asked


def test_tied_embeddings_are_accepted() -> None:
    """Megatron's default for GPT models (no --untie-embeddings-and-output-weights), with either optimizer."""
    validate_odyssey_args(_megatron_like_args(["--odyssey"], untie_embeddings_and_output_weights=False))
    validate_odyssey_args(_megatron_like_args(["--odyssey"], untie_embeddings_and_output_weights=False,
                                              use_distributed_optimizer=True, num_distributed_optimizer_instances=2))


def test_tied_embeddings_with_core_r0_12s_distributed_optimizer_instances_are_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """core_r0.12.0's distributed optimizer in two instances computes another gradient for tied embeddings than
    its plain optimizer (docs/benchmarks.md): refused on that release only, with the way out."""
    from megatron_odyssey import arguments
    from megatron_odyssey.megatron_lm.versions import MegatronVersion

    tied_distopt = dict(untie_embeddings_and_output_weights=False, use_distributed_optimizer=True,
                        num_distributed_optimizer_instances=2)
    monkeypatch.setattr("megatron_odyssey.megatron_lm.versions.installed_version", lambda: MegatronVersion(0, 12, 0))
    with pytest.raises(OdysseyArgumentError, match="core_r0.12.0's distributed optimizer in several instances"):
        validate_odyssey_args(_megatron_like_args(["--odyssey"], **tied_distopt))
    validate_odyssey_args(_megatron_like_args(["--odyssey"], untie_embeddings_and_output_weights=False))
    monkeypatch.setattr("megatron_odyssey.megatron_lm.versions.installed_version", lambda: MegatronVersion(0, 13, 0))
    assert arguments._megatron_minor() == 13
    validate_odyssey_args(_megatron_like_args(["--odyssey"], **tied_distopt))


def test_killing_checkpoint_writers_is_refused_where_they_are_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """kind=kill-writer kills the writer processes core_r0.12-0.16's save forks; from core_r0.17.0 on they are
    threads of the rank, and the fault would do nothing: refused, saying so."""
    from megatron_odyssey.megatron_lm.versions import MegatronVersion

    flags = ["--odyssey", "--odyssey-inject-fault", "step=1,rank=1,phase=save,kind=kill-writer"]
    for minor in (12, 16):
        monkeypatch.setattr("megatron_odyssey.megatron_lm.versions.installed_version", lambda: MegatronVersion(0, minor, 0))
        validate_odyssey_args(_megatron_like_args(flags))
    monkeypatch.setattr("megatron_odyssey.megatron_lm.versions.installed_version", lambda: MegatronVersion(0, 17, 0))
    with pytest.raises(OdysseyArgumentError, match="core_r0.17's checkpoint writers are threads of the rank"):
        validate_odyssey_args(_megatron_like_args(flags))
    with pytest.raises(OdysseyArgumentError, match="kind=kill-writer kills the checkpoint writers of a save: use "
                                                   "phase=save"):
        validate_odyssey_args(_megatron_like_args(["--odyssey", "--odyssey-inject-fault", "step=1,rank=1,kind=kill-writer"]))


def test_reaching_the_time_limit_needs_one() -> None:
    """kind=deadline sets the job's clock past --exit-duration-in-mins at a chosen step: without that flag it would
    do nothing, so it is refused at start-up, naming the flag."""
    flags = ["--odyssey", "--odyssey-inject-fault", "step=3,rank=0,phase=between,kind=deadline"]
    validate_odyssey_args(_megatron_like_args(flags, exit_duration_in_mins=60.0))
    for unset in ({}, {"exit_duration_in_mins": None}):
        with pytest.raises(OdysseyArgumentError, match=r"--odyssey-inject-fault 'step=3,rank=0,phase=between,"
                                                       r"kind=deadline': kind=deadline reaches the job's time limit, "
                                                       r"but --exit-duration-in-mins is not set"):
            validate_odyssey_args(_megatron_like_args(flags, **unset))


def test_a_batch_size_ramp_is_accepted() -> None:
    """A failure inside the ramp stops the job with the checkpoint to relaunch from; past it, recovery works
    (megatron_lm.batch_ramp)."""
    validate_odyssey_args(_megatron_like_args(["--odyssey"], rampup_batch_size=["16", "8", "1000"]))
    validate_odyssey_args(_megatron_like_args(["--odyssey"], step_batch_size_schedule="0:8 1000:16"))


def test_evaluation_during_training_is_accepted() -> None:
    """Megatron's defaults evaluate (100 iterations every 1000): --odyssey runs it in any layout."""
    validate_odyssey_args(_megatron_like_args(["--odyssey"], eval_iters=100, eval_interval=5))


def test_tensor_parallelism_without_extra_weight_shards_is_accepted() -> None:
    """megatron-core 0.19+ sets --tensor-parallel-num-weight-shards to the TP size when it is not given."""
    validate_odyssey_args(_megatron_like_args(["--odyssey"], tensor_model_parallel_size=2,
                                              tensor_parallel_num_weight_shards=2))


def test_distributed_optimizer_with_replicated_shards_is_accepted() -> None:
    validate_odyssey_args(_megatron_like_args(["--odyssey"], use_distributed_optimizer=True,
                                              num_distributed_optimizer_instances=2))


def test_distributed_optimizer_with_both_overlaps_is_accepted() -> None:
    """--overlap-param-gather works through a failure (test_megatron_lm.py); Megatron itself asks for the
    distributed optimizer and --overlap-grad-reduce with it."""
    validate_odyssey_args(_megatron_like_args(["--odyssey"], use_distributed_optimizer=True,
                                              num_distributed_optimizer_instances=2, overlap_grad_reduce=True,
                                              overlap_param_gather=True))


def test_fp16_is_accepted_with_fp32_gradient_accumulation() -> None:
    """--fp16 works (megatron_lm.loss_scale) with --accumulate-allreduce-grads-in-fp32, machines coming back too."""
    validate_odyssey_args(_megatron_like_args(["--odyssey"], fp16=True, accumulate_allreduce_grads_in_fp32=True))
    validate_odyssey_args(_megatron_like_args(["--odyssey", "--odyssey-rejoin", "1@2"], fp16=True,
                                              accumulate_allreduce_grads_in_fp32=True))


def test_every_refused_flag_is_named_at_once() -> None:
    """A job with several refused flags learns all of them from one launch, not one per attempt."""
    ns = _megatron_like_args(["--odyssey"], use_distributed_optimizer=True, fp16=True, calculate_per_token_loss=True,
                             accumulate_allreduce_grads_in_fp32=True, dataloader_type="external")
    with pytest.raises(OdysseyArgumentError) as info:
        validate_odyssey_args(ns)
    text = str(info.value)
    assert text.startswith("3 flags cannot be used with --odyssey")
    for flag in ("--num-distributed-optimizer-instances", "--fp16 and --calculate-per-token-loss",
                 "--dataloader-type external"):
        assert flag in text


def test_without_odyssey_nothing_changes() -> None:
    ns = _megatron_like_args([], use_distributed_optimizer=True, overlap_grad_reduce=True)
    validate_odyssey_args(ns)
    assert ns.barrier_with_L1_time is True


# -- dispatcher -------------------------------------------------------------------------------------------

class _Runtime:
    """The part of a rank's runtime the dispatcher talks to (node id and run_schedule)."""

    def __init__(self, node: int):
        self.node, self.calls = node, []

    def run_schedule(self, forward_step_func, step):
        self.calls.append((forward_step_func, step))
        return [{"lm loss": torch.tensor([0.0, 1.0])}]


def test_dispatcher_switches_to_plan_schedule_after_plan_change(gloo_world: None) -> None:
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    from megatron_odyssey.megatron_lm.schedule import ForwardBackwardDispatcher, PlanSchedule

    dispatcher = get_forward_backward_func()  # what train() captures once, before its loop
    assert isinstance(dispatcher, ForwardBackwardDispatcher)
    assert dispatcher.select() is forward_backward_no_pipelining  # no runtime: Megatron's own schedule

    plan = symmetric_plan(pp=2, dp=3, num_layers=4, num_micro_batches=6)  # nodes: stage s, replica d -> s*3+d
    runtime = _Runtime(node=1)  # stage 0 of replica 1
    STATE.runtime, STATE.plan = runtime, plan
    first = dispatcher.select()
    assert isinstance(first, PlanSchedule) and first.operations == node_operations(plan)[1]

    rerouted = reroute_plan(plan, frozenset({0}))  # stage 0 of replica 0 dies: a twin adopts its micro-batches
    STATE.plan = rerouted
    after = dispatcher.select()
    assert isinstance(after, PlanSchedule) and after.plan is rerouted
    adopted = {op.micro_batch for op in after.operations if op.pipeline == 0}
    mine = {op.micro_batch for op in after.operations if op.pipeline == 1}
    assert mine == {0, 1}
    adopters = {r.peer for r in rerouted.reroutes}
    assert (1 in adopters) == bool(adopted)
    assert sum(len({op.micro_batch for op in node_operations(rerouted)[n] if op.pipeline == 0})
               for n in (1, 2)) == 2  # the dead node's two micro-batches, each adopted exactly once
    dispatcher(forward_step_func="fwd", data_iterator=None, model=[], num_microbatches=2, seq_length=8,
               micro_batch_size=1, forward_only=False, odyssey_step=7)
    assert runtime.calls == [("fwd", 7)]


def test_after_an_evaluation_iterations_schedule_a_rank_waits_on_its_peers(gloo_world: None) -> None:
    """From core_r0.19.0 on evaluate() all-reduces each iteration's losses over the data-parallel group after the
    schedule: a rank there waits on a replica that may have stopped in its forward, so it is marked as communicating
    until its next forward (the agent blames the replica, not it); a training step's schedule leaves it working."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_odyssey.runtime.liveness import COMM, WORKING, Progress

    class Evaluating(_Runtime):
        def __init__(self) -> None:
            super().__init__(node=1)
            self.progress = Progress()

        def run_evaluation(self, forward_step_func, data_iterator):
            self.progress.mark(3, "eval")  # (each forward marks progress)
            return [{"lm loss": torch.tensor([0.0, 1.0])}]

    runtime = Evaluating()
    STATE.runtime, STATE.plan = runtime, symmetric_plan(pp=2, dp=3, num_layers=4, num_micro_batches=6)
    dispatcher = get_forward_backward_func()
    flags = dict(forward_step_func="fwd", data_iterator=None, model=[], num_microbatches=2, seq_length=8,
                 micro_batch_size=1)
    dispatcher(**flags, forward_only=True)
    assert runtime.progress.state == COMM
    runtime.progress.mark(3, "forward")
    dispatcher(**flags, forward_only=False, odyssey_step=3)
    assert runtime.progress.state == WORKING and runtime.calls == [("fwd", 3)]


# -- stage layer ranges and the gradient norm ---------------------------------------------------------

def test_stage_range_builds_global_layer_numbers(gloo_world: None) -> None:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_odyssey.runtime.model import ModelConfig, make_transformer_config

    cfg = ModelConfig(num_layers=5, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=8,
                      vocab_size=64)
    tc = make_transformer_config(cfg, 5)
    STATE.stage_range = (2, 4)
    model = GPTModel(tc, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=8,
                     pre_process=False, post_process=False)
    assert [layer.layer_number for layer in model.decoder.layers] == [3, 4]
    STATE.stage_range = None
    whole = GPTModel(tc, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=8)
    assert [layer.layer_number for layer in whole.decoder.layers] == [1, 2, 3, 4, 5]


def test_optimizer_uses_the_agreed_norm(gloo_world: None) -> None:
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mopt

    grads = [torch.full((4,), 3.0)]
    # the optimizer's alias wraps megatron's own norm (which needs CUDA, so it is not called here) ...
    assert mopt.get_grad_norm_fp32.__odyssey_original__ is clip_grads.get_grad_norm_fp32
    STATE.grad_norm = 2.5  # ... and returns the norm agreed before the commit, with no collective
    assert mopt.get_grad_norm_fp32(grads) == 2.5


# -- releases ---------------------------------------------------------------------------------------------

def test_every_patch_targets_known_releases() -> None:
    from megatron_odyssey.megatron_lm.versions import KNOWN_RELEASES

    assert sorted(KNOWN_RELEASES) == list(range(12, 21)) and KNOWN_RELEASES[20] == "main"
    for patch in adaptor.PATCHES:
        low, high = patch.releases
        assert low in KNOWN_RELEASES and high in KNOWN_RELEASES and low <= high, patch.target


def test_unknown_release_is_refused_with_the_known_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_odyssey.megatron_lm import patches
    from megatron_odyssey.megatron_lm.versions import MegatronVersion

    monkeypatch.setattr(patches, "installed_version", lambda: MegatronVersion(0, 21, 0))
    with pytest.raises(OdysseyArgumentError, match=r"megatron-core 0\.21\.0 is not a release.*core_r0\.12\.0.*core_r0\.19\.0, main"):
        patches.check_release()
    monkeypatch.setattr(patches, "installed_version", lambda: None)
    with pytest.raises(OdysseyArgumentError, match="megatron-core is not importable"):
        patches.check_release()


def test_unknown_release_is_not_half_patched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the flag patches (so --odyssey can be refused clearly); megatron-core's own stay untouched."""
    from megatron_odyssey.megatron_lm import patches
    from megatron_odyssey.megatron_lm.versions import MegatronVersion

    core_target = "megatron.core.pipeline_parallel:get_forward_backward_func"
    adaptor.remove_patches()
    monkeypatch.setattr(patches, "installed_version", lambda: MegatronVersion(0, 21, 0))
    assert patches.apply_for_installed_release()[core_target] != "applied"
    owner, attr = _resolve(core_target)
    assert not hasattr(getattr(owner, attr), adaptor.ORIGINAL_ATTR)
    monkeypatch.setattr(patches, "installed_version", lambda: MegatronVersion(0, 16, 1))
    assert patches.apply_for_installed_release()[core_target] == "applied"


def test_a_known_release_missing_a_target_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The megatron-core wheel alone has no megatron.training: as a 0.16 Megatron-LM job it would be half-patched."""
    from megatron_odyssey.megatron_lm import patches
    from megatron_odyssey.megatron_lm.versions import MegatronVersion

    monkeypatch.setattr(patches, "installed_version", lambda: MegatronVersion(0, 16, 1))
    missing = patches.missing_patches(16)
    assert "megatron.training.training:train_step" in missing
    assert "megatron.training.initialize:parse_args" in missing  # 0.12-0.17 have it
    assert "megatron.core.utils:get_batch_on_this_tp_rank" not in missing  # 0.18+ only
    with pytest.raises(OdysseyArgumentError, match="did not apply: .*train_step"):
        patches.check_release()


def test_python_3_11_gets_typing_override() -> None:
    import typing

    from megatron_odyssey.megatron_lm.versions import provide_python312_names

    provide_python312_names()

    @typing.override  # what Megatron-LM 0.18+'s megatron/training/models/*.py import
    def f() -> int:
        return 1

    assert f() == 1
