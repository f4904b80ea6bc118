"""What one ``odyssey simulate`` run is: the job, the failure process, the policies, the costs.

Defaults reproduce the Odyssey paper's simulation (§V-B): 32 NPUs (910B-class), Llama-2-7B,
10% failures per NPU-hour, 9 hours, compared policies Odyssey / Oobleck / ReCycle. The paper
does not give the simulated (PP, DP, TP) or batch; we take (4, 8, 1) (its 8- and 16-NPU runs
used PP=4, TP=1) and global batch 64 (the top of its 16-64 range) with micro-batch 1.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import SimulationError
from .failslow import SlowClass, resolve_fail_slow
from .profiles import MODEL_NAMES

DEFAULT_POLICIES = ("odyssey", "oobleck", "recycle", "checkpoint", "fault-scaled")
EXTRA_POLICIES = ("odyssey-f1", "odyssey-nofill", "odyssey-ignore-slow", "odyssey-slow-as-failure", "recycle-nofill",
                  "recycle-nostagger", "ideal")
POLICY_NAMES = DEFAULT_POLICIES + EXTRA_POLICIES


def parse_policies(text: str | None) -> tuple[str, ...]:
    """``--policies odyssey,oobleck`` -> ("odyssey", "oobleck"); None -> the defaults. Unknown,
    repeated or no names are errors that name ``--policies``."""
    if text is None:
        return DEFAULT_POLICIES
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    if not names:
        raise SimulationError(f"--policies names no policy; choose from {', '.join(POLICY_NAMES)}")
    unknown = [p for p in names if p not in POLICY_NAMES]
    if unknown:
        raise SimulationError(f"--policies: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(POLICY_NAMES)}")
    repeated = sorted({p for p in names if names.count(p) > 1})
    if repeated:
        raise SimulationError(f"--policies lists {', '.join(repeated)} more than once")
    return names


_FLAGS = {"npus": "--npus", "tp": "--tp", "pp": "--pp", "dp": "--dp", "global_batch": "--global-batch",
          "micro_batch": "--micro-batch", "seeds": "--seeds"}


def _flag(name: str) -> str:
    """The ``odyssey simulate`` flag of a field: messages name what the user typed."""
    return _FLAGS.get(name, name)


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@dataclass(frozen=True)
class SimulationConfig:
    # -- the job (mirrors `odyssey simulate --npus N --tp T --pp P --dp D`) ------------------------
    npus: int = 32
    tp: int = 1
    pp: int = 4
    dp: int = 8
    model: str = "llama2-7b"
    profile: str | None = None  # a profile JSON file (planning.profile format) instead of a built-in model
    num_layers: int | None = None  # None: the model's own depth
    seq_length: int | None = None  # None: the model's default
    global_batch: int = 64  # samples per step
    micro_batch: int = 1
    # -- failures: exactly one process -------------------------------------------------------------
    failure_rate: float | None = 0.1  # failures per device-hour (Poisson per device)
    failure_interval_h: float | None = None  # one failure per interval for the whole cluster
    trace: str | None = None  # replay a spot trace instead (failure_rate is then ignored)
    # -- fail-slow: laid over the failure process (failslow.py); a preset name or SlowClass objects ----------
    fail_slow: str | tuple[SlowClass, ...] | None = None
    hours: float = 9.0
    seeds: int = 20
    first_seed: int = 0
    policies: tuple[str, ...] = DEFAULT_POLICIES
    # -- checkpointing and restarts ------------------------------------------------------------
    checkpoint_interval_s: float | None = None  # None: the profile's (30 min)
    checkpoint_save_s: float = 0.0  # training stall per save (0: asynchronous saving)
    checkpoint_load_s: float = 60.0  # part of a restart
    relaunch_s: float = 240.0  # job relaunch; relaunch + load = the profile's 300 s restart
    # -- in-process overheads (None: the profile's values) --------------------------------------
    reroute_overhead_s: float | None = None
    rebuild_overhead_s: float | None = None
    # -- policy knobs ---------------------------------------------------------------------------
    mtbf_hours: float | None = None  # per device, for Eq. 8; None: 1 / failure rate
    search: str = "heuristic"  # Odyssey planner search
    oobleck_f: int = 1  # Oobleck's fault-tolerance threshold f (>= f+1 pipelines)
    oobleck_rebuild_s: float | None = None  # sensitivity only: Oobleck's own rebuild overhead (None: shared)
    recycle_residual_bubble: float = 2 / 9  # share of a stage's bubble ReCycle cannot fill (closed form only)
    recycle_model: str = "play"  # "play": the estimator's filled-reroute play; "closed-form": the r = 2/9 model
    lose_partial_step: bool = True  # a failure mid-step loses the step's work (half a step on average)
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)  # free-form labels copied into the JSON

    def __post_init__(self) -> None:
        for name in ("npus", "tp", "pp", "dp", "global_batch", "micro_batch", "seeds"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SimulationError(f"{_flag(name)} must be a positive integer, got {v!r}")
        if self.npus != self.tp * self.pp * self.dp:
            raise SimulationError(f"--npus {self.npus} must equal --tp x --pp x --dp = {self.tp} x {self.pp} x {self.dp} "
                                  f"= {self.tp * self.pp * self.dp}")
        if self.global_batch % (self.micro_batch * self.dp):
            raise SimulationError(f"--global-batch {self.global_batch} is not divisible by --micro-batch x --dp = "
                                  f"{self.micro_batch} x {self.dp} = {self.micro_batch * self.dp}")
        if self.profile is None and self.model not in MODEL_NAMES:
            raise SimulationError(f"--model {self.model}: not a built-in model; choose one of {', '.join(MODEL_NAMES)}")
        if not _finite(self.hours) or not self.hours > 0:
            raise SimulationError(f"--hours must be a positive number of hours, got {self.hours}")
        if not self.policies:
            raise SimulationError(f"--policies names no policy; choose from {', '.join(POLICY_NAMES)}")
        unknown = [p for p in self.policies if p not in POLICY_NAMES]
        if unknown:
            raise SimulationError(f"--policies: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(POLICY_NAMES)}")
        repeated = sorted({p for p in self.policies if list(self.policies).count(p) > 1})
        if repeated:
            raise SimulationError(f"--policies lists {', '.join(repeated)} more than once")
        processes = [x is not None for x in (self.failure_interval_h, self.trace)]
        if sum(processes) > 1:
            raise SimulationError("give at most one failure process: failure_interval_h or --trace")
        if self.trace is None and self.failure_interval_h is None:
            if self.failure_rate is None or not _finite(self.failure_rate) or self.failure_rate < 0:
                raise SimulationError(f"--failure-rate must be >= 0 failures per device-hour, got {self.failure_rate}")
        if self.failure_interval_h is not None and not self.failure_interval_h > 0:
            raise SimulationError(f"failure_interval_h must be positive hours, got {self.failure_interval_h}")
        if self.mtbf_hours is not None and not self.mtbf_hours > 0:
            raise SimulationError(f"--mtbf-hours must be positive, got {self.mtbf_hours}")
        if self.oobleck_f < 0:
            raise SimulationError(f"Oobleck's f must be >= 0, got {self.oobleck_f}")
        for name in ("checkpoint_save_s", "checkpoint_load_s", "relaunch_s"):
            if getattr(self, name) < 0:
                raise SimulationError(f"{name} must be >= 0, got {getattr(self, name)}")
        object.__setattr__(self, "fail_slow", resolve_fail_slow(self.fail_slow))
        if self.trace is not None:
            object.__setattr__(self, "failure_rate", None)
        object.__setattr__(self, "policies", tuple(self.policies))

    @property
    def num_nodes(self) -> int:
        """Nodes (TP groups) the job asks for; no policy uses more, whatever the cluster offers."""
        return self.pp * self.dp

    @property
    def horizon_s(self) -> float:
        return self.hours * 3600.0

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch // self.micro_batch

    @property
    def process(self) -> str:
        if self.trace is not None:
            return "trace"
        return "interval" if self.failure_interval_h is not None else "poisson"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["policies"] = list(self.policies)
        out["process"] = self.process
        if self.trace is not None:
            out["trace"] = str(Path(self.trace))
        return out
