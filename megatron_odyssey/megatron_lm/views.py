"""Megatron's objects seen through the interfaces Odyssey's runtime works with: a model chunk and the job's own
``forward_step`` as a pipeline stage (``StageRunner``), the torch optimizers inside a Megatron optimizer as one
optimizer state keyed by parameter, and a chunk's parameters under plan-independent global names.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from ..runtime.state import TIED_ALIASES
from . import rerun
from .hooks import sub_optimizers


class MegatronStageRunner:
    """StageRunner over a Megatron model chunk and the job's own ``forward_step`` function."""

    def __init__(self, chunk: Any, is_first: bool, is_last: bool):
        self.chunk, self.is_first, self.is_last = chunk, is_first, is_last
        self.forward_step_func: Callable[..., Any] | None = None

    def forward(self, batch: Mapping[str, torch.Tensor], input_tensor: torch.Tensor | None) -> torch.Tensor:
        from megatron.core.utils import get_attr_wrapped_model

        get_attr_wrapped_model(self.chunk, "set_input_tensor")(input_tensor)
        out = self.forward_step_func(iter([dict(batch)]), self.chunk)  # (output_tensor, loss_func)
        if self.is_last:  # the executor computes the loss from this per-token loss; the script's checks run here
            rerun.check_loss(out[1], out[0])
        return out[0]


class OptimizerStateView:
    """The ``state`` of the torch optimizer(s) inside a Megatron optimizer, keyed by the parameter that
    holds fp32 values (the model parameter in fp32, the main copy under bf16)."""

    def __init__(self, megatron_optimizer: Any):
        self.inner: dict[int, torch.optim.Optimizer] = {}
        self.main_of: dict[int, torch.nn.Parameter] = {}  # id(model param) -> fp32 param the optimizer steps
        for opt in sub_optimizers(megatron_optimizer):
            torch_opt = opt.optimizer
            model_groups = getattr(opt, "float16_groups", None)
            main_groups = getattr(opt, "fp32_from_float16_groups", None)
            if model_groups is not None:
                for mg, fg in zip(model_groups, main_groups):
                    for mp, fp in zip(mg, fg):
                        self.main_of[id(mp)] = fp
            for group in torch_opt.param_groups:
                for p in group["params"]:
                    self.inner[id(p)] = torch_opt

    def main_param(self, p: torch.nn.Parameter) -> torch.nn.Parameter:
        return self.main_of.get(id(p), p)

    @property
    def state(self) -> "OptimizerStateView":
        return self

    def get(self, p: torch.nn.Parameter, default: Any = None) -> Any:
        opt = self.inner.get(id(p))
        return default if opt is None else opt.state.get(p, default)

    def __setitem__(self, p: torch.nn.Parameter, value: Any) -> None:
        self.inner[id(p)].state[p] = value


def megatron_global_names(chunk: Any, layer_start: int) -> list[tuple[str, torch.nn.Parameter]]:
    """(plan-independent global name, parameter) for a Megatron model chunk whose first layer is ``layer_start``."""
    from ..runtime.model import to_global_name

    return [(to_global_name(name, layer_start), p) for name, p in chunk.named_parameters()]


#: the tied embedding weight's names: the word embeddings, and the output layer's copy on a stage without them
TIED_NAMES = (*TIED_ALIASES.values(), *TIED_ALIASES)
