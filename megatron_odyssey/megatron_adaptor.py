"""Megatron-LM drop-in: ``import megatron_odyssey.megatron_adaptor`` at the top of ``pretrain_gpt.py``
(after ``import mindspeed.megatron_adaptor`` on Ascend) and add ``--odyssey`` to the flags.

Every change to Megatron is one :class:`Patch` in :data:`PATCHES` (kept in
:mod:`megatron_odyssey.megatron_lm.patches`): the Megatron name it replaces, a factory that wraps the
original, and why. Importing this module applies them (:func:`apply_patches`, idempotent);
:func:`remove_patches` puts every original back. Patches whose
module is not importable (``megatron.training`` is not in the megatron-core wheel) are skipped and
reported by :func:`patch_status`. Each replacement defers to the original unless ``--odyssey`` is on
and a runtime is active, so the import alone changes nothing about a job.

Aliases matter: ``from x import f`` copies the name, so a function used through such an import is
patched where it is used (``initialize.parse_args``, ``training.get_forward_backward_func``...).
"""
from __future__ import annotations

from .megatron_lm.hooks import ORIGINAL_ATTR
from .megatron_lm.versions import provide_python312_names
from .megatron_lm.patches import (PATCHES, Patch, apply_for_installed_release, apply_patches, describe_patches,
                                  patch_status, remove_patches)

__all__ = ["ORIGINAL_ATTR", "PATCHES", "Patch", "apply_patches", "describe_patches", "patch_status", "remove_patches"]


def _cpu_mode_if_no_accelerator() -> None:
    """Real Megatron-LM training on CPU (tests, laptops): only when no CUDA/NPU device exists."""
    import importlib.util

    from .runtime.accelerator import detect_device_type

    if importlib.util.find_spec("megatron.training") is not None and detect_device_type() == "cpu":
        try:
            from .megatron_lm.cpu_mode import enable_megatron_lm_cpu_mode
        except ImportError:
            return
        enable_megatron_lm_cpu_mode()


provide_python312_names()
apply_for_installed_release()
_cpu_mode_if_no_accelerator()
