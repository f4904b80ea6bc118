"""The ``--odyssey-*`` argument group that Megatron-LM's ``parse_args`` gains, and its validation.

Pure argparse, no Megatron import: the adaptor adds :func:`add_odyssey_args` to Megatron's parser
and runs :func:`validate_odyssey_args` after Megatron's own ``validate_args``, so a bad combination
stops the job before any process group or model exists, with a message naming the flag to change.
"""
from __future__ import annotations

import argparse
import math
from typing import Any

from .planning.slow import SLOW_ACTIONS

#: what --odyssey-policy / odyssey train --policy accept: Eq. 8's choice, or a recovery kind forced
POLICIES = ("auto", "reroute", "fill", "stagger", "reconfigure", "normalise")
#: --odyssey-policy: the Megatron-LM host runs no staggered optimizer (its update clips by the plan-wide gradient
#: norm, which needs every stage's gradients before any stage may update; TrainConfig.stagger)
MEGATRON_POLICIES = tuple(p for p in POLICIES if p != "stagger")
#: --odyssey-slow-action / --slow-action: Eq. 8's choice, one forced, or no diagnosis
SLOW_ACTION_CHOICES = ("auto", *SLOW_ACTIONS, "off")

# Megatron features whose state or communication is laid out for one uniform grid; each would be
# silently wrong (or hang) on a rerouted or asymmetric plan. (attribute, flag, why)
_INCOMPATIBLE: tuple[tuple[str, str, str], ...] = (
    ("use_torch_fsdp2", "--use-torch-fsdp2", "FSDP shards parameters over one uniform data-parallel group"),
    ("use_megatron_fsdp", "--use-megatron-fsdp", "FSDP shards parameters over one uniform data-parallel group"),
    # Megatron's own resiliency (README, "Megatron's own resiliency"): one recovery system per failure
    ("inprocess_restart", "--inprocess-restart",
     "nvidia-resiliency-ext's in-process restart re-runs the whole training function on every rank after a "
     "fault, tearing down the process groups Odyssey recovers on, so both would act on one failure; Odyssey "
     "recovers in-process without restarting the survivors"),
    ("enable_ft_package", "--enable-ft-package",
     "nvidia-resiliency-ext's fault-tolerance launcher (ft_launcher) restarts the job when a rank's heartbeat "
     "stops; odyssey-launch replaces it and Odyssey's agent detects the same failures and recovers without a "
     "restart"),
    ("log_straggler", "--log-straggler",
     "the straggler detector gathers every rank's timings over the original world at each log interval, "
     "which waits forever once a rank is dead"),
    ("check_weight_hash_across_dp_replicas_interval", "--check-weight-hash-across-dp-replicas-interval",
     "it compares weight hashes over Megatron's uniform data-parallel groups, which after a failure hold one rank "
     "each (nothing would be compared: the plan's replicas are not a data-parallel group), and then waits in a "
     "world barrier outside any step"),
    *((attr, flag,
       "low-precision training keeps each layer's scaling state (Transformer Engine's amax history and scales) in the "
       "module, outside the parameters and optimizer state Odyssey moves when it rebuilds a stage after a failure: "
       "the rebuilt layers would start that history afresh and train differently from stock (unchecked on a GPU, "
       "whose image here has no Transformer Engine); train in bf16")
      for attr, flag in (("fp8", "--fp8-format"), ("fp4", "--fp4-format"))),
    ("gpu_sniff_test_interval", "--gpu-sniff-test-interval",
     "Megatron-LM's GPU sniff test (main, not yet in a release) benchmarks send/receive, reduce-scatter and "
     "all-to-all over Megatron's uniform data-, tensor- and expert-parallel groups between iterations, which after "
     "a failure no longer describe the job (a data-parallel group then holds one rank), and waits for every rank "
     "outside any step; Odyssey's diagnosis names a slow rank or link from every iteration's own operations "
     "(--odyssey-slow-action)"),
)


class OdysseyArgumentError(ValueError):
    """A flag combination Odyssey cannot run; the message names the flag and the fix."""


def parse_rejoin(specs: list[str], flag: str = "--rejoin") -> list[dict[str, int]]:
    """``R@S`` specs (``odyssey train --rejoin``, ``--odyssey-rejoin``) -> [{"rank": R, "after_step": S}]."""
    out = []
    for spec in specs:
        rank, _, step = spec.partition("@")
        if not (rank.strip().isdigit() and step.strip().isdigit()):
            raise OdysseyArgumentError(f"{flag} {spec!r}: expected RANK@STEP, e.g. {flag} 5@6")
        out.append({"rank": int(rank), "after_step": int(step)})
    return out


def add_odyssey_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``odyssey`` group (used as, or chained into, Megatron's ``extra_args_provider``)."""
    if any(a.dest == "odyssey" for a in parser._actions):  # already added (idempotent)
        return parser
    g = parser.add_argument_group(title="odyssey", description="keep training through accelerator failures")
    g.add_argument("--odyssey", action="store_true",
                   help="enable failure recovery by rerouting or re-arranging pipelines in-process")
    g.add_argument("--odyssey-policy", choices=MEGATRON_POLICIES, default="auto",
                   help="auto: the performance model chooses per failure; reroute (1F1B), fill (reroute with "
                        "weight gradients deferred into pipeline bubbles), reconfigure, normalise (a few nodes "
                        "change stage so failures spread, then reroute): force one when feasible (default: auto)")
    g.add_argument("--odyssey-max-cached-failures", type=int, default=1, metavar="K",
                   help="precompute plans for every set of up to K failed nodes (0: plan on demand; default 1)")
    g.add_argument("--odyssey-mtbf-hours", type=float, default=None, metavar="H",
                   help="mean time between failures per device, weighing a transition's cost against its "
                        "speed-up (Eq. 8; default: the planner's 50000 h)")
    g.add_argument("--odyssey-heartbeat-timeout", type=float, default=30.0, metavar="S",
                   help="seconds without a heartbeat before a rank is declared hung and fenced (default 30)")
    g.add_argument("--odyssey-soft-timeout", type=float, default=60.0, metavar="S",
                   help="seconds a rank may work inside an iteration without progress (stuck in a collective "
                        "or a kernel while its heartbeat goes on) before it is named and its stacks are dumped "
                        "to its log (default 60, as --inprocess-soft-timeout)")
    g.add_argument("--odyssey-hard-timeout", type=float, default=90.0, metavar="S",
                   help="seconds without progress inside an iteration before the rank is fenced (SIGKILL) and "
                        "the job recovers without it (default 90, as --inprocess-hard-timeout)")
    g.add_argument("--odyssey-first-step-timeout", type=float, default=600.0, metavar="S",
                   help="seconds the first iteration of the job, and the first after each recovery, may take (it "
                        "connects, allocates and compiles) before progress is judged in it as in any other "
                        "(default 600)")
    g.add_argument("--odyssey-slow-action", choices=SLOW_ACTION_CHOICES, default="auto",
                   help="what to do about a rank the diagnosis names slow (its compute per micro-batch at least twice "
                        "its data-parallel twins' over 5 iterations): auto (the planner chooses by Eq. 8 between "
                        "carrying on, rebalancing its pipeline's micro-batches and dropping it as if failed), force "
                        "none|rebalance|drop where feasible, or off (no diagnosis)")
    g.add_argument("--odyssey-profile-iters", type=int, default=0, metavar="N",
                   help="time the first N iterations with Megatron's timers and plan from the measured "
                        "per-layer costs instead of the analytical estimate (default 0: estimate)")
    for link, what in (("p2p", "activations between pipeline stages"),
                       ("allreduce", "a stage's data-parallel gradient all-reduce (bus bandwidth)"),
                       ("transfer", "weights and optimizer state moved during a reconfiguration")):
        g.add_argument(f"--odyssey-{link}-bandwidth", type=float, default=None, metavar="GB/s",
                       help=f"per-device bandwidth (GB/s, 1e9 bytes) of {what}, for the planner; default by "
                            f"device kind: inside one server NVLink 150 (CUDA) / HCCS 56 (Ascend), between "
                            f"servers 25 (one 200 Gb/s NIC per device); see README")
    g.add_argument("--odyssey-report", default=None, metavar="FILE",
                   help="write per-iteration and per-failure records (JSON) here")
    g.add_argument("--odyssey-inject-fault", action="append", default=[], metavar="SPEC",
                   help="testing: step=I,rank=R,phase=forward|backward|grad-sync|optimizer|data|recovery|log|save|between|"
                        "eval|exit|end,kind=kill|hang|stall|block|slow|error|crash|kill-writer|sigterm|deadline (repeatable; end: after the last "
                        "iteration, at the barrier after train() returns; rank is the launch-time global rank; "
                        "error: the rank raises, as a local bug would; crash: it segfaults in native code; "
                        "kill-writer (phase=save): the save's checkpoint writer processes are SIGKILLed as they start; "
                        "sigterm: the rank gets SIGTERM itself (with --exit-signal-handler Megatron ends the job); "
                        "deadline: the job's --exit-duration-in-mins is reached at that iteration (Megatron's exit check "
                        "after it ends the job); "
                        "kind=slow,factor=F[,steps=N]: its compute F times slower from iteration I on, for N "
                        "iterations or to the end; kind=exit,code=C: the rank leaves with C by the script's own "
                        "choice, as Megatron's rerun state machine does)")
    g.add_argument("--odyssey-rejoin", action="append", default=[], metavar="RANK@STEP",
                   help="testing: rank R's machine comes back after iteration S (repeatable). Its replacement, "
                        "started with `odyssey-launch --join` at any time, asks to join once that iteration is "
                        "committed and R is dead, and the agent holds the next commit until it has asked (bounded "
                        "by the store timeout), so where it joins does not depend on how fast it started")
    return parser


def megatron_feature_refusals(args: Any) -> list[str]:
    """Every Megatron feature in ``args`` that --odyssey cannot run, each with its reason (all of them,
    so one launch names every flag to change)."""
    out: list[str] = []
    instances = int(getattr(args, "num_distributed_optimizer_instances", 1) or 1)
    if getattr(args, "use_distributed_optimizer", False) and instances < 2:
        out.append("--odyssey needs --num-distributed-optimizer-instances 2 (or more) with "
                   "--use-distributed-optimizer: with one instance each rank holds the only copy of its shard of "
                   "the Adam state, which a failure takes with it; with N instances every shard lives on N ranks "
                   "(bf16: 6 + 12N/d bytes per parameter over d data-parallel ranks, against 18 without the "
                   "distributed optimizer)")
    for attr, flag, why in _INCOMPATIBLE:
        if getattr(args, attr, False):
            out.append(f"--odyssey cannot be combined with {flag}: {why}. Remove {flag}.")
    for attr, flag in (("context_parallel_size", "--context-parallel-size"),
                       ("expert_model_parallel_size", "--expert-model-parallel-size")):
        if getattr(args, attr, 1) not in (None, 1):
            out.append(f"--odyssey supports tensor, pipeline and data parallelism; {flag} "
                                       f"{getattr(args, attr)} is not supported (set it to 1)")
    if (not getattr(args, "untie_embeddings_and_output_weights", True) and getattr(args, "use_distributed_optimizer", False)
            and instances >= 2 and _megatron_minor() == 12):
        out.append("--odyssey cannot reproduce core_r0.12.0's distributed optimizer in several instances with tied "
                   "embeddings: that release's own gradient for the pair differs from its plain optimizer's (on a "
                   "tiny GPT its gradient norm is 1.41x, and the losses part from the third iteration), which no "
                   "layout after a failure can match; use megatron-core 0.13 or later, "
                   "--untie-embeddings-and-output-weights, or one instance without --odyssey")
    if getattr(args, "fp16", False) and not getattr(args, "accumulate_allreduce_grads_in_fp32", False):
        out.append("--odyssey needs --accumulate-allreduce-grads-in-fp32 with --fp16: with fp16 gradient buffers a plan "
                   "sums the data-parallel replicas' gradients before scaling them by 1/DP (stock scales first) and a "
                   "survivor accumulates a dead peer's micro-batches too, so a buffer can overflow where stock's does "
                   "not and the loss scaler would skip other iterations (seen with DP=4); add "
                   "--accumulate-allreduce-grads-in-fp32")
    if getattr(args, "fp16", False) and getattr(args, "calculate_per_token_loss", False):
        out.append("--odyssey cannot be combined with --fp16 and --calculate-per-token-loss together: a plan's backward "
                   "runs at stock's magnitudes (so the loss scaler overflows where stock's does) only for Megatron's "
                   "per-micro-batch mean loss; use --bf16, or leave out --calculate-per-token-loss")
    if getattr(args, "log_num_zeros_in_grad", False):
        out.append("--odyssey cannot be combined with --log-num-zeros-in-grad: the count is a "
                   "collective over the uniform model-parallel group after the step's commit")
    out.extend(evaluation_refusals(args))
    if getattr(args, "save", None) and getattr(args, "ckpt_format", "torch_dist") != "torch_dist":
        out.append(f"--odyssey saves checkpoints in the torch_dist format only: --ckpt-format "
                   f"{args.ckpt_format} writes one file per pipeline rank, which a job re-arranged "
                   f"after a failure does not have (its checkpoints load at any layout from "
                   f"torch_dist); remove --ckpt-format or set it to torch_dist")
    from .megatron_lm.versions import stock_save_blocker

    if getattr(args, "save", None) and (why := stock_save_blocker(_megatron_minor())):
        out.append(f"--save cannot work in this environment: {why}. Stock Megatron-LM fails the same way at its "
                   f"first save, losing the iterations before it; change the environment, or leave out --save")
    if getattr(args, "async_save", False):
        out.append("--odyssey cannot be combined with --async-save: a save still being written "
                   "by Megatron's background worker when a rank fails can be neither finished nor "
                   "abandoned by the survivors; remove --async-save")
    if getattr(args, "non_persistent_ckpt_type", None) == "local":
        out.append("--odyssey cannot be combined with --non-persistent-ckpt-type local: nvidia-resiliency-ext's local "
                   "checkpoint manager keeps each rank's shard on its own node, replicated over rank groups fixed at "
                   "start-up, while a re-arranged job holds other shards and its recovery restores from torch_dist "
                   "checkpoints; use --non-persistent-ckpt-type global")
    if getattr(args, "num_experts", None):
        out.append("--odyssey plans dense models; --num-experts (MoE) is not supported")
    if getattr(args, "mtp_num_layers", None):
        out.append(f"--odyssey cannot be combined with --mtp-num-layers {args.mtp_num_layers} (multi-token "
                   f"prediction): its layers sit on the last stage after the decoder, with their own copy of the word "
                   f"embeddings, and add their loss inside the model's forward, while Odyssey's planner, stage rebuild "
                   f"and state transfer know the embedding, the transformer layers and the output layer only; and "
                   f"stock MTP cannot run on a CPU (its loss tracker asks for a CUDA device) to check a recovery "
                   f"against. Leave out --mtp-num-layers")
    # 0.19+ resolves it to the TP size when not given (no extra weight shards); more shards is GTP
    shards, tp = getattr(args, "tensor_parallel_num_weight_shards", None), getattr(args, "tensor_model_parallel_size", 1)
    if shards not in (None, 1, tp):
        out.append(f"--odyssey cannot be combined with --tensor-parallel-num-weight-shards {shards} (more than "
                   f"--tensor-model-parallel-size {tp}): its weight-rematerialising groups are laid out for one "
                   f"uniform grid (leave it out)")
    if getattr(args, "dataloader_type", "single") not in (None, "single", "cyclic"):
        out.append(f"--odyssey reads a dead peer's micro-batches as Megatron's own sampler would have given them "
                   f"(--dataloader-type single or cyclic); --dataloader-type {args.dataloader_type} is the script's own "
                   f"data loader, which a survivor cannot ask for another rank's samples")
    return out


def _megatron_minor() -> int | None:
    """The installed megatron-core's minor version (None without one)."""
    from .megatron_lm.versions import installed_version

    version = installed_version()
    return version.minor if version is not None and version.major == 0 else None


def evaluation_refusals(args: Any) -> list[str]:
    """Evaluation runs in any layout (megatron_lm.evaluation) with the training batch's micro-batches and the
    loss alone; these ways of evaluating cannot."""
    out = []
    for attr, flag, why in (
            ("full_validation", "--full-validation", "it reads the whole validation split from sample 0 in "
             "batches that need not split like the training batch"),
            ("multiple_validation_sets", "--multiple-validation-sets", "it evaluates several validation splits, "
             "which Odyssey does not keep apart"),
            ("sft", "--sft", "its evaluation averages per-micro-batch means over the data-parallel ranks")):
        if getattr(args, attr, False) and getattr(args, "eval_iters", 0):
            out.append(f"--odyssey cannot evaluate with {flag}: {why}. Remove {flag} or set --eval-iters 0.")
    for attr, flag, train_attr in (("eval_global_batch_size", "--eval-global-batch-size", "global_batch_size"),
                                   ("eval_micro_batch_size", "--eval-micro-batch-size", "micro_batch_size")):
        value, train = getattr(args, attr, None), getattr(args, train_attr, None)
        if value is not None and train is not None and value != train and getattr(args, "eval_iters", 0):
            out.append(f"--odyssey evaluates with the training batch's micro-batches (every plan splits those): "
                       f"{flag} {value} differs from --{train_attr.replace('_', '-')} {train}; leave {flag} out")
    if getattr(args, "step_batch_size_schedule", None) and getattr(args, "eval_iters", 0):
        out.append("--odyssey cannot evaluate with --step-batch-size-schedule: Megatron's evaluate() then reads "
                   "batches of --global-batch-size's default (micro-batch x data-parallel size), not the schedule's "
                   "final batch that every plan splits; set --eval-iters 0")
    return out


def odyssey_flags_given(args: Any) -> list[str]:
    """The ``--odyssey-*`` options set away from their defaults (to reject them without ``--odyssey``)."""
    defaults = vars(add_odyssey_args(argparse.ArgumentParser()).parse_args([]))
    return ["--" + k.replace("_", "-") for k, v in defaults.items()
            if k != "odyssey" and getattr(args, k, v) != v]


def ends_after(step: int, train_iters: int, exit_interval: int | None) -> bool:
    """Megatron's training loop ends after 0-based ``step`` (its iteration ``step + 1``): --train-iters' last, or
    the one --exit-interval's check ends it after (``checkpoint_and_decide_exit``: iteration % interval == 0,
    counted from 0 however the job started). Exits on a signal or a duration cannot be known ahead."""
    return step + 1 >= train_iters or bool(exit_interval) and (step + 1) % int(exit_interval) == 0


def last_step_from(start: int, train_iters: int, exit_interval: int | None) -> int:
    """The first step at or after ``start`` that :func:`ends_after` (a job resumed from iteration ``start``)."""
    end = train_iters - 1
    if exit_interval:
        end = min(end, (start // int(exit_interval) + 1) * int(exit_interval) - 1)
    return end


def _last_iteration(args: Any) -> int | None:
    """The iteration the job's loop ends after, for a job starting at iteration 0 (a resumed one's start is read
    from its checkpoint later: the agent asks :func:`ends_after` per step); unknown with an exit on a signal or a
    duration."""
    train_iters = getattr(args, "train_iters", None)
    if train_iters is None or getattr(args, "exit_signal_handler", False) or getattr(args, "exit_duration_in_mins", None):
        return None
    return last_step_from(0, train_iters, getattr(args, "exit_interval", None)) + 1


def _check_megatron_fault_injector(args: Any) -> None:
    """Megatron's ``--fault-injector-*`` (core_r0.18+; megatron_lm.fault_injection) works with --odyssey, but stock
    finds its fault library only at train()'s start, on every rank at once: say so here, naming the flag."""
    import importlib.util

    flag = next((f for attr, f in (("fault_injector_ranks", "--fault-injector-ranks"),
                                   ("fault_injector_num_ranks", "--fault-injector-num-ranks"))
                 if getattr(args, attr, None) is not None), None)
    if flag is None:
        return
    try:
        found = importlib.util.find_spec("nvidia_resiliency_ext.shared_utils.inject_fault") is not None
    except ModuleNotFoundError:  # no nvidia_resiliency_ext at all
        found = False
    if not found:
        raise OdysseyArgumentError(
            f"{flag} needs nvidia-resiliency-ext 0.6 or later: Megatron's fault injector imports "
            f"nvidia_resiliency_ext.shared_utils.inject_fault, which this environment lacks (0.4 keeps it under "
            f"inprocess.tools). Install nvidia-resiliency-ext>=0.6 or remove the --fault-injector-* flags")


def validate_odyssey_args(args: Any) -> None:
    """Raise :class:`OdysseyArgumentError` for flags Odyssey cannot honour; adjust harmless ones.

    Called after Megatron's ``validate_args`` (so world size, data-parallel size and micro-batch
    counts are known)."""
    if not getattr(args, "odyssey", False):
        stray = odyssey_flags_given(args)
        if stray:
            raise OdysseyArgumentError(f"{', '.join(stray)} given without --odyssey; add --odyssey to enable recovery")
        return
    if args.odyssey_max_cached_failures < 0:
        raise OdysseyArgumentError(f"--odyssey-max-cached-failures must be >= 0, got {args.odyssey_max_cached_failures}")
    if args.odyssey_mtbf_hours is not None and not args.odyssey_mtbf_hours > 0:
        raise OdysseyArgumentError(f"--odyssey-mtbf-hours must be > 0, got {args.odyssey_mtbf_hours}")
    if not getattr(args, "odyssey_first_step_timeout", 600.0) > 0:
        raise OdysseyArgumentError(f"--odyssey-first-step-timeout must be positive, got {args.odyssey_first_step_timeout}")
    if not 0 < args.odyssey_soft_timeout < args.odyssey_hard_timeout:
        raise OdysseyArgumentError(f"--odyssey-soft-timeout must be positive and shorter than --odyssey-hard-timeout, "
                                   f"got {args.odyssey_soft_timeout} and {args.odyssey_hard_timeout}")
    if not args.odyssey_heartbeat_timeout > 0:
        raise OdysseyArgumentError(f"--odyssey-heartbeat-timeout must be > 0 seconds, got {args.odyssey_heartbeat_timeout}")
    if args.odyssey_profile_iters < 0:
        raise OdysseyArgumentError(f"--odyssey-profile-iters must be >= 0, got {args.odyssey_profile_iters}")
    for link in ("p2p", "allreduce", "transfer"):
        value = getattr(args, f"odyssey_{link}_bandwidth", None)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise OdysseyArgumentError(f"--odyssey-{link}-bandwidth must be a positive number of GB/s, got {value}")
    refusals = megatron_feature_refusals(args)
    if refusals:
        raise OdysseyArgumentError(refusals[0] if len(refusals) == 1 else
                                   f"{len(refusals)} flags cannot be used with --odyssey:\n  - " + "\n  - ".join(refusals))
    from .runtime.faults import FailSpec
    from .planning.errors import PlanningError

    world = getattr(args, "world_size", None)
    train_iters = getattr(args, "train_iters", None)
    for text in args.odyssey_inject_fault:
        try:
            spec = FailSpec.parse(text)
        except PlanningError as exc:
            raise OdysseyArgumentError(str(exc).replace("--fail", "--odyssey-inject-fault")) from None
        if world is not None and spec.rank >= world:
            raise OdysseyArgumentError(f"--odyssey-inject-fault {text!r}: rank {spec.rank} does not exist "
                                       f"(world size {world})")
        if train_iters is not None and spec.step >= train_iters:
            raise OdysseyArgumentError(f"--odyssey-inject-fault {text!r}: step {spec.step} is not before "
                                       f"--train-iters {train_iters}")
        minor = _megatron_minor() if spec.kind == "kill-writer" else None
        if minor is not None and minor >= 17:
            raise OdysseyArgumentError(f"--odyssey-inject-fault {text!r}: core_r0.{minor}'s checkpoint writers are "
                                       f"threads of the rank (core_r0.17.0 on), not processes of their own: none can "
                                       f"die alone (core_r0.12-0.16 fork them)")
        if spec.kind == "deadline" and not getattr(args, "exit_duration_in_mins", None):
            raise OdysseyArgumentError(f"--odyssey-inject-fault {text!r}: kind=deadline reaches the job's time limit, "
                                       f"but --exit-duration-in-mins is not set")
        last = _last_iteration(args)
        if spec.phase == "end" and last is not None and spec.step != last - 1:
            raise OdysseyArgumentError(f"--odyssey-inject-fault {text!r}: phase=end fires once, after the last "
                                       f"iteration: give step={last - 1}")
    _check_megatron_fault_injector(args)
    for r in parse_rejoin(args.odyssey_rejoin, "--odyssey-rejoin"):
        if (world is not None and r["rank"] >= world) or (train_iters is not None and r["after_step"] >= train_iters):
            raise OdysseyArgumentError(f"--odyssey-rejoin {r['rank']}@{r['after_step']}: the rank must be one of the "
                                       f"job's 0..{(world or 1) - 1} and the iteration one of 0..{(train_iters or 1) - 1}")
    if args.odyssey_policy == "reroute" and getattr(args, "data_parallel_size", 2) < 2:
        raise OdysseyArgumentError("--odyssey-policy reroute needs a data-parallel peer to take over a dead "
                                   "node's micro-batches, but the data-parallel size is 1")
    # world barriers inside timers would wait forever for a dead rank (DESIGN.md, timers)
    if getattr(args, "barrier_with_L1_time", False):
        args.barrier_with_L1_time = False
