"""Model names the simulator accepts: the planning layer's registry (``planning.models``), so that
``odyssey simulate --model`` and ``odyssey plan --profile`` take the same names.

``gpt3-medium-a100`` (ReCycle's fidelity setting) lives in ``planning.gpt3``; it is re-exported here
for existing imports.
"""
from __future__ import annotations

from ..planning.errors import PlanningError
from ..planning.gpt3 import GPT3_ASSUMPTIONS, GPT3_MEDIUM, A100Spec, GPTShape, gpt3_medium_profile
from ..planning.models import BUILTIN_MODELS, build_builtin
from ..planning.profile import ModelProfile
from .errors import SimulationError

MODEL_NAMES = tuple(BUILTIN_MODELS)

__all__ = ["GPT3_ASSUMPTIONS", "GPT3_MEDIUM", "A100Spec", "GPTShape", "MODEL_NAMES", "gpt3_medium_profile",
           "resolve_model"]


def resolve_model(model: str, num_layers: int | None, tp: int, micro_batch: int,
                  seq_length: int | None = None) -> ModelProfile:
    """Built-in model name -> profile."""
    try:
        return build_builtin(model, num_layers, tp, micro_batch, seq_length, flag="--model")
    except PlanningError as exc:
        raise SimulationError(str(exc)) from None
