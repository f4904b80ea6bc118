"""What ``odyssey train`` runs: one JSON-serialisable config shared by the launcher and every rank."""
from __future__ import annotations

import json
import signal
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..arguments import POLICIES, SLOW_ACTION_CHOICES
from ..planning.errors import PlanningError
from ..planning.plan import ExecutionPlan, symmetric_plan

#: fault kinds only a Megatron-LM job (odyssey-launch, the --odyssey flags) can fire, and why odyssey train cannot
KINDS_OF_MEGATRON_JOBS = {
    "kill-machine": "kills a launcher of odyssey-launch and its ranks; odyssey train runs on one machine (use "
                    "kill-agent or kill-with-agent)",
    "deadline": "reaches Megatron-LM's --exit-duration-in-mins; odyssey train has no time limit (use --steps)",
    "kill-writer": "kills the processes Megatron's checkpoint save forks; odyssey train's save forks none (use "
                   "kind=kill at phase=save)",
}


@dataclass
class TrainConfig:
    nproc: int = 4
    tp: int = 1
    pp: int = 2
    layers: int = 4
    hidden: int = 64
    heads: int = 4
    seq: int = 32
    global_batch: int = 8
    micro_batch: int = 1
    steps: int = 3
    seed: int = 1234
    ffn_hidden: int | None = None  # default: Llama-style ~8/3 x hidden, rounded to 16
    vocab: int = 320  # >= the byte tokenizer's 258, divisible by TP
    lr: float = 1e-3
    # dropout: masks keyed to (seed, step, global micro-batch, layer), not to the rank (runtime.dropout_rng)
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    data_path: str | None = None  # Megatron indexed dataset prefix; None = megatron's mock dataset
    plan: dict[str, Any] | None = None  # explicit plan JSON (e.g. rerouted or asymmetric); else symmetric
    save_params: str | None = None
    report: str | None = None
    # estimator-fidelity mode: every layer sleeps instead of computing (seconds per micro-batch)
    sleep_forward_s: float | None = None
    sleep_backward_s: float | None = None
    backend: str | None = None  # default from the accelerator (gloo on CPU)
    # several ranks on one GPU/NPU (tests): every rank binds device 0 and talks over gloo
    shared_device: bool = False
    timeout_s: float = 120.0
    # fault tolerance
    fail: list[str] = field(default_factory=list)  # --fail specs (runtime.faults.FailSpec text)
    policy: str = "auto"  # auto | reroute | fill | stagger | reconfigure | normalise
    # the host runs the staggered optimizer (ExecutionPlan.stagger): the planner offers it only then
    stagger: bool = True
    # after a failure, start each layer's gradient all-reduce during the last backward (grad_sync); Megatron-LM
    # jobs: --overlap-grad-reduce, which their generation 0 runs as Megatron's own DDP
    overlap_grad_reduce: bool = False
    # a slow node the diagnosis names: auto (Eq. 8 between carrying on, rebalancing and dropping it), or force
    # one of them where feasible; off: no diagnosis of slowness at all (hangs are still caught)
    slow_action: str = "auto"
    heartbeat_interval_s: float = 0.2
    heartbeat_timeout_s: float = 5.0  # 2-core CI with 8 ranks; use 30-60 s on real clusters
    # progress (not liveness): a rank working inside a step that makes no progress for soft_timeout_s is
    # named and its stacks dumped; for hard_timeout_s it is fenced (runtime.liveness)
    soft_timeout_s: float = 20.0
    hard_timeout_s: float = 40.0
    # a generation's first step connects, allocates and compiles: judged by progress only after this long
    first_step_timeout_s: float = 600.0
    # the signal that asks a rank to dump its stacks into its log (faulthandler): SIGUSR1, unless the job uses it
    # (Megatron's --exit-signal, what a SLURM --signal=USR1@... warning sends): SIGUSR2 then
    stack_dump_signal: int = int(signal.SIGUSR1)
    checkpoint_interval: int = 2  # steps between checkpoints (0: never)
    workdir: str | None = None  # checkpoints and logs
    mtbf_hours: float | None = None  # per device, for Eq. 8; None: planner default
    profile_out: str | None = None  # write the measured per-layer profile (planner format) here
    # layers per pipeline stage of the launch layout when not Megatron's uniform split (a Megatron-LM job's
    # --decoder-first/last-pipeline-num-layers, --account-for-*-in-pipeline-split, --pipeline-model-parallel-layout)
    layer_split: list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def dropout(self) -> bool:
        return self.hidden_dropout > 0 or self.attention_dropout > 0

    @property
    def num_nodes(self) -> int:
        return self.nproc // self.tp

    @property
    def dp(self) -> int:
        return self.num_nodes // self.pp

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch // self.micro_batch

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 16 * -(-(8 * self.hidden // 3) // 16)

    def validate(self) -> ExecutionPlan:
        """Check everything before any process starts; returns the plan to run."""
        for name in ("nproc", "tp", "pp", "layers", "hidden", "heads", "seq", "global_batch", "micro_batch", "steps"):
            if getattr(self, name) < 1:
                raise PlanningError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.nproc % self.tp:
            raise PlanningError(f"--nproc {self.nproc} is not a multiple of --tp {self.tp}")
        if self.hidden % self.heads:
            raise PlanningError(f"--hidden {self.hidden} is not divisible by --heads {self.heads}")
        if self.heads % self.tp or self.vocab % self.tp:
            raise PlanningError(f"--heads {self.heads} and the vocabulary {self.vocab} must be divisible by --tp {self.tp}")
        if self.policy not in POLICIES:
            raise PlanningError(f"--policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.policy == "stagger" and not self.stagger:
            raise PlanningError("--policy stagger: this host does not run the staggered optimizer (Megatron-LM's update "
                                "clips by the gradient norm of the whole model, known only once every stage is done)")
        if self.slow_action not in SLOW_ACTION_CHOICES:
            raise PlanningError(f"--slow-action must be one of {', '.join(SLOW_ACTION_CHOICES)}, got {self.slow_action!r}")
        if not self.heartbeat_timeout_s > self.heartbeat_interval_s:
            raise PlanningError(f"--heartbeat-timeout must be longer than the heartbeat interval "
                                f"{self.heartbeat_interval_s} s, got {self.heartbeat_timeout_s}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise PlanningError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(self, name)}")
        if not self.first_step_timeout_s > 0:
            raise PlanningError(f"--first-step-timeout must be positive, got {self.first_step_timeout_s}")
        if not 0 < self.soft_timeout_s < self.hard_timeout_s:
            raise PlanningError(f"--soft-timeout must be positive and shorter than --hard-timeout, got "
                                f"{self.soft_timeout_s} and {self.hard_timeout_s}")
        if not self.hard_timeout_s < self.timeout_s:
            raise PlanningError(f"--hard-timeout {self.hard_timeout_s} s must be shorter than the collectives' "
                                f"timeout {self.timeout_s} s (a stalled rank is fenced before its peers time out)")
        if self.checkpoint_interval < 0:
            raise PlanningError(f"--checkpoint-interval must be >= 0 (0: never), got {self.checkpoint_interval}")
        if self.mtbf_hours is not None and not self.mtbf_hours > 0:
            raise PlanningError(f"--mtbf-hours must be positive, got {self.mtbf_hours}")
        if self.data_path is not None:
            missing = [s for s in (".bin", ".idx") if not Path(self.data_path + s).is_file()]
            if missing:
                raise PlanningError(f"--data-path {self.data_path}: no {' or '.join(self.data_path + s for s in missing)} "
                                    f"(give the prefix of a Megatron indexed dataset, without .bin/.idx)")
        from .faults import PHASES, FailSpec

        seen: dict[tuple[int, int], tuple[FailSpec, str]] = {}
        for text in self.fail:
            spec = FailSpec.parse(text)
            earlier, said = seen.get((spec.rank, spec.step), (None, ""))
            # one fault per rank and step, or a one-off slowness first, then another fault at a later phase
            if earlier is not None and not (earlier.kind == "slow" and not earlier.factor
                                             and PHASES.index(earlier.phase) < PHASES.index(spec.phase)):
                raise PlanningError(f"--fail {text!r}: rank {spec.rank} already fails in step {spec.step} "
                                    f"({said!r}); give one fault per rank and step (or a kind=slow at an earlier "
                                    "phase first)")
            seen[spec.rank, spec.step] = (spec, text)
            if spec.rank >= self.nproc:
                raise PlanningError(f"--fail {text!r}: rank {spec.rank} does not exist (ranks 0..{self.nproc - 1})")
            if spec.step >= self.steps:
                raise PlanningError(f"--fail {text!r}: step {spec.step} is past the last step {self.steps - 1}")
            if spec.phase == "log" and not self.extra.get("megatron"):
                raise PlanningError(f"--fail {text!r}: phase=log is Megatron-LM's training_log; odyssey train has no "
                                    f"log phase (use between, save or data)")
            if spec.phase == "end" and not self.extra.get("megatron"):
                raise PlanningError(f"--fail {text!r}: phase=end is Megatron-LM's barrier after train() returns; "
                                    f"odyssey train has no end phase (use between on the last step)")
            if spec.kind in KINDS_OF_MEGATRON_JOBS and not self.extra.get("megatron"):
                raise PlanningError(f"--fail {text!r}: kind={spec.kind} {KINDS_OF_MEGATRON_JOBS[spec.kind]}")
            if spec.phase == "save" and not self.extra.get("megatron") and not self.checkpoint_interval:
                raise PlanningError(f"--fail {text!r}: phase=save needs checkpoints (--checkpoint-interval > 0)")
        for r in self.extra.get("rejoin", []):
            if not 0 <= int(r["rank"]) < self.nproc or not 0 <= int(r["after_step"]) < self.steps:
                raise PlanningError(f"--rejoin {r['rank']}@{r['after_step']}: the rank must be one of the job's "
                                    f"0..{self.nproc - 1} and the step before the last ({self.steps - 1})")
        if self.global_batch % self.micro_batch:
            raise PlanningError(f"--global-batch {self.global_batch} is not divisible by --micro-batch {self.micro_batch}")
        if self.plan is not None:
            try:
                plan = ExecutionPlan.from_dict(self.plan)
            except (AttributeError, KeyError, TypeError, ValueError) as exc:
                why = str(exc) if isinstance(exc, PlanningError) else f"{type(exc).__name__}: {exc}"
                raise PlanningError(f"--plan: not an execution plan ({why}); write one with "
                                    f"ExecutionPlan.to_dict() or take `plan` from `odyssey plan --json`") from None
            if plan.num_layers != self.layers:
                raise PlanningError(f"--plan is for {plan.num_layers} layers, --layers is {self.layers}")
            try:
                plan.validate(num_micro_batches=self.num_micro_batches, valid_nodes=range(self.num_nodes))
            except PlanningError as exc:
                raise PlanningError(f"--plan cannot run here: {exc}") from None
            return plan
        if self.num_nodes % self.pp:
            raise PlanningError(f"{self.num_nodes} nodes (--nproc / --tp) are not a multiple of --pp {self.pp}")
        if self.pp > self.layers:
            raise PlanningError(f"--pp {self.pp} is greater than --layers {self.layers}")
        if self.num_micro_batches % self.dp:
            raise PlanningError(f"--global-batch {self.global_batch} is not divisible by --micro-batch x DP "
                                f"= {self.micro_batch} x {self.dp} (DP = --nproc / (--tp x --pp))")
        return self.launch_plan()

    def launch_plan(self) -> ExecutionPlan:
        """The launch layout: DP identical pipelines, the layers split uniformly or as ``layer_split`` says."""
        split = self.layer_split
        if split is not None and (len(split) != self.pp or sum(split) != self.layers or min(split) < 1):
            raise PlanningError(f"layer split {list(split)} does not give each of the {self.pp} pipeline stages at "
                                f"least one of the {self.layers} layers")
        return symmetric_plan(self.pp, self.dp, self.layers, self.num_micro_batches,
                              layer_split=tuple(split) if split else None)

    def fail_specs(self):
        from .faults import FailSpec

        return [FailSpec.parse(t) for t in self.fail]

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: str | Path) -> "TrainConfig":
        return cls(**json.loads(Path(path).read_text()))

    def model_config(self):
        from .model import ModelConfig

        return ModelConfig(num_layers=self.layers, hidden_size=self.hidden, num_attention_heads=self.heads,
                           ffn_hidden_size=self.ffn, seq_length=self.seq, vocab_size=self.vocab, seed=self.seed,
                           hidden_dropout=self.hidden_dropout, attention_dropout=self.attention_dropout)

    def data_config(self):
        from .data import DataConfig

        return DataConfig(seq_length=self.seq, micro_batch_size=self.micro_batch, global_batch_size=self.global_batch,
                          train_steps=self.steps, seed=self.seed, data_path=self.data_path)
