"""Megatron-LM drop-in: ``import megatron_odyssey.megatron_adaptor`` at the top of ``pretrain_gpt.py``
(after ``import mindspeed.megatron_adaptor`` on Ascend) and add ``--odyssey`` to the flags.

Every change to Megatron is one :class:`Patch` in :data:`PATCHES` (kept in
:mod:`megatron_odyssey.megatron_lm.patches`): the Megatron name it replaces, a factory that wraps the
original, and why. Importing this module applies them (:func:`apply_patches`, idempotent);
:func:`remove_patches` puts every original back. Patches whose
module is not importable (``megatron.training`` is not in the megatron-core wheel) are skipped and
reported by :func:`patch_status`. Each replacement defers to the original unless ``--odyssey`` is on
and a runtime is active, so the import alone changes nothing about a job; one exception: in the CPU mode a job
that ends cleanly destroys its process groups first (``megatron_lm.clean_exit``: torch's gloo threads can abort
the interpreter's shutdown).

Aliases matter: ``from x import f`` copies the name, so a function used through such an import is
patched where it is used (``initialize.parse_args``, ``training.get_forward_backward_func``...).
"""
from __future__ import annotations

from .megatron_lm.hooks import ORIGINAL_ATTR
from .megatron_lm.versions import provide_python312_names
from .megatron_lm.patches import (PATCHES, Patch, apply_for_installed_release, apply_patches, describe_patches,
                                  patch_status, remove_patches)

__all__ = ["ORIGINAL_ATTR", "PATCHES", "Patch", "apply_patches", "describe_patches", "patch_status", "remove_patches"]


#: tests on a machine with one GPU: every rank of the machine on device 0, device tensors over gloo via host copies
SHARED_DEVICE_ENV = "ODYSSEY_SHARED_DEVICE"


def _shared_device_if_asked() -> None:
    """``ODYSSEY_SHARED_DEVICE=1`` (tests; ``runtime.host_staging``): NCCL refuses two ranks on one device and
    Megatron-LM binds each rank to ``cuda:LOCAL_RANK``, so a machine with one GPU runs a multi-rank job only with
    every rank told it is local rank 0, over gloo (``--distributed-backend gloo``), its device tensors carried
    through host copies. ``stage-all`` stages host tensors too (how a CPU machine checks the staging). Before any
    patch: the staging replaces names megatron-core takes at import."""
    import os

    mode = os.environ.get(SHARED_DEVICE_ENV, "")
    if not mode:
        return
    if mode not in ("1", "stage-all"):
        raise ValueError(f"{SHARED_DEVICE_ENV}={mode!r}: expected 1 (ranks share device 0) or stage-all (and "
                         f"stage host tensors too)")
    from .runtime.host_staging import enable_host_staging

    os.environ["LOCAL_RANK"] = "0"
    enable_host_staging(stage_host_tensors=mode == "stage-all")


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
_shared_device_if_asked()
apply_for_installed_release()
_cpu_mode_if_no_accelerator()
