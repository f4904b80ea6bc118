"""Built-in model profiles by name, and ``--profile NAME|FILE`` resolution.

One registry for every command: ``odyssey plan --profile`` and ``odyssey simulate --model`` /
``--profile`` accept exactly the same names (a second list is how ``plan`` once rejected a name
``simulate`` accepted). Error messages name the user's flag, so the CLI can print them as they are.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import PlanningError
from .gpt3 import GPT3_MEDIUM, gpt3_medium_profile
from .profile import SHAPES, ModelProfile, builtin_profile

DEFAULT_MODEL = "llama2-7b"

# (num_layers, tp, micro_batch, seq_length) -> profile; None means the model's own value
Builder = Callable[[int | None, int, int, int | None], ModelProfile]


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    description: str
    num_layers: int
    build: Builder


def _llama(name: str) -> Builder:
    def build(num_layers: int | None, tp: int, micro_batch: int, seq_length: int | None) -> ModelProfile:
        return builtin_profile(name, num_layers=num_layers, tp=tp, micro_batch=micro_batch,
                               seq_length=seq_length or 4096)
    return build


def _gpt3(num_layers: int | None, tp: int, micro_batch: int, seq_length: int | None) -> ModelProfile:
    return gpt3_medium_profile(num_layers, tp=tp, micro_batch=micro_batch, seq_length=seq_length)


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "llama2-7b": BuiltinModel("llama2-7b", "Llama-2-7B on a 910B-class NPU", SHAPES["llama2-7b"].num_layers,
                              _llama("llama2-7b")),
    "llama2-70b": BuiltinModel("llama2-70b", "Llama-2-70B on a 910B-class NPU", SHAPES["llama2-70b"].num_layers,
                               _llama("llama2-70b")),
    "gpt3-medium-a100": BuiltinModel("gpt3-medium-a100", "GPT-3 Medium on A100 80 GB (ReCycle's setting)",
                                     GPT3_MEDIUM.num_layers, _gpt3),
}


def builtin_help() -> str:
    """``llama2-7b, llama2-70b, gpt3-medium-a100``: for help texts and error messages."""
    return ", ".join(BUILTIN_MODELS)


def build_builtin(name: str, num_layers: int | None = None, tp: int = 1, micro_batch: int = 1,
                  seq_length: int | None = None, flag: str = "--model") -> ModelProfile:
    if name not in BUILTIN_MODELS:
        raise PlanningError(f"{flag} {name}: not a built-in model; choose one of {builtin_help()}")
    return BUILTIN_MODELS[name].build(num_layers, tp, micro_batch, seq_length)


def resolve_profile(spec: str | None, num_layers: int | None, tp: int, micro_batch: int,
                    flag: str = "--profile") -> ModelProfile:
    """``--profile`` value -> profile: a built-in name, a profile JSON file, or the default model.

    A file must describe the job it is used for: its layer count, TP size and micro-batch size are
    what its per-layer costs were measured at, so a mismatch is an error rather than a wrong estimate."""
    if spec is None or spec in BUILTIN_MODELS:
        return build_builtin(spec or DEFAULT_MODEL, num_layers, tp, micro_batch, flag=flag)
    path = Path(spec)
    if not path.exists():
        raise PlanningError(f"{flag} {spec}: no such file, and not a built-in model "
                            f"(built-in: {builtin_help()})")
    profile = ModelProfile.load(path, source=f"{flag} {spec}")
    checks = (("--layers", num_layers, profile.num_layers, f"describes {profile.num_layers} layers"),
              ("--tp", tp, profile.tp, f"was made at TP {profile.tp}"),
              ("--micro-batch", micro_batch, profile.micro_batch, f"was made at micro-batch {profile.micro_batch}"))
    for user_flag, wanted, has, what in checks:
        if wanted is not None and wanted != has:
            raise PlanningError(f"{flag} {spec} {what}, but {user_flag} is {wanted}: a profile holds the per-layer "
                                "costs of one job shape; use a profile made for this one")
    return profile
