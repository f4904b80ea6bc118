"""Which Megatron-LM releases the adaptor knows, and the one Python shim the newest need on 3.11.

A release we have not checked is refused with ``--odyssey`` (see ``arguments``) rather than patched
half-way: the registry's targets move between releases (``initialize.parse_args`` is gone in 0.18,
0.19 builds models without ``training.get_model``), and a patch that silently misses its target
turns recovery into a hang.
"""
from __future__ import annotations

import importlib
import sys
import typing
from dataclasses import dataclass

#: megatron-core minor version -> the Megatron-LM branch it was checked on (main: 0.20 pre-release).
KNOWN_RELEASES: dict[int, str] = {**{minor: f"core_r0.{minor}.0" for minor in range(12, 20)}, 20: "main"}


#: releases whose ``pretrain_gpt.py`` loss function all-reduces each micro-batch's reported loss over the
#: data-parallel group (``train_step`` then adds the micro-batches up); later ones add each rank's micro-batches first
LOSS_REDUCED_PER_MICRO_BATCH = frozenset({12})


#: releases whose ``ChainedOptimizer.step`` counts the gradient's zeros at every step (``train_step`` then logs
#: "num zeros"), ``--log-num-zeros-in-grad`` or not; later ones count only when asked
COUNTS_ZEROS_EVERY_STEP = frozenset({12})


#: releases whose torch_dist checkpoints do not record how they hold a distributed optimizer's state (its content
#: metadata's ``distrib_optim_sharding_type`` came in 0.13): the job says which format it writes instead
OPTIMIZER_FORMAT_UNRECORDED = frozenset({12})


@dataclass(frozen=True)
class MegatronVersion:
    major: int
    minor: int
    patch: int

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"

    @property
    def known(self) -> bool:
        return self.major == 0 and self.minor in KNOWN_RELEASES

    @property
    def loss_reduced_per_micro_batch(self) -> bool:
        return self.major == 0 and self.minor in LOSS_REDUCED_PER_MICRO_BATCH

    @property
    def counts_zeros_every_step(self) -> bool:
        return self.major == 0 and self.minor in COUNTS_ZEROS_EVERY_STEP

    @property
    def records_optimizer_format(self) -> bool:
        return not (self.major == 0 and self.minor in OPTIMIZER_FORMAT_UNRECORDED)

    @property
    def branch(self) -> str:
        return KNOWN_RELEASES.get(self.minor, f"core_r{self.major}.{self.minor}.0") if self.major == 0 else str(self)


def installed_version() -> MegatronVersion | None:
    """The megatron-core that ``import megatron.core`` finds (a checkout's own, before the wheel)."""
    try:
        info = importlib.import_module("megatron.core.package_info")
    except ImportError:
        return None
    return MegatronVersion(int(info.MAJOR), int(info.MINOR), int(info.PATCH))


def known_releases_text() -> str:
    return ", ".join(KNOWN_RELEASES.values())


def unknown_version_error(version: MegatronVersion | None) -> str:
    if version is None:
        return "megatron-core is not importable; --odyssey runs inside a Megatron-LM job"
    return (f"megatron-core {version} is not a release megatron-odyssey has been checked against; known: "
            f"{known_releases_text()} (megatron-core 0.12 to 0.20.0 pre-release). Run without --odyssey, or "
            f"use a known release")


def stock_save_blocker(minor: int | None) -> str | None:
    """Why this release's own torch_dist save cannot work beside the numpy, torch and psutil installed, or None. Stock
    Megatron-LM fails the same way (or, without psutil on core_r0.13-0.16, hangs), but only at its first save, with every iteration
    before it lost; ``--odyssey`` says so at start-up instead (``arguments``)."""
    if minor is None:
        return None
    reasons = []
    if minor <= 15:
        import numpy

        if not hasattr(numpy, "product"):
            reasons.append(f"core_r0.{minor}'s dist-checkpointing calls numpy.product, which numpy 2 removed "
                           f"(installed: numpy {numpy.__version__}): install numpy<2, or use megatron-core 0.16+")
    if minor == 12:
        import inspect

        import torch
        from torch.distributed.checkpoint.filesystem import _write_item

        needed = inspect.signature(_write_item).parameters.get("serialization_format")
        if needed is not None and needed.default is inspect.Parameter.empty:
            reasons.append(f"core_r0.12's torch_dist writer (dist_checkpointing/strategies/filesystem_async.py) calls "
                           f"torch.distributed.checkpoint's _write_item without the serialization_format argument "
                           f"that torch {torch.__version__} requires (0.13 passes it): use megatron-core 0.13+, or "
                           f"the torch release core_r0.12 was built with")
    try:
        import psutil  # noqa: F401
    except ImportError:
        how = ("imports it at the first save" if minor == 12 else
               "processes ask it for their memory outside their error handling (_process_memory): each dies at its "
               "start, and the save waits for them forever" if minor <= 16 else
               "asks it for its memory (_process_memory) in the rank's own thread, and the first save fails")
        reasons.append(f"core_r0.{minor}'s torch_dist writer (dist_checkpointing/strategies/filesystem_async.py) "
                       f"needs psutil, which is not installed; the writer {how}: pip install psutil (one of "
                       f"Megatron-LM's requirements)")
    return "; and ".join(reasons) or None


def provide_python312_names() -> None:
    """Megatron-LM 0.18+ asks for Python 3.12 in its metadata, but its code parses and runs on 3.11
    except for ``from typing import override`` (``megatron/training/models/*.py``): on 3.11 that name
    comes from ``typing_extensions``, the same decorator (a no-op marker at run time)."""
    if sys.version_info < (3, 12) and not hasattr(typing, "override"):
        from typing_extensions import override

        typing.override = override  # type: ignore[attr-defined]
