"""``--log-energy`` through failures: Megatron's ``EnergyMonitor`` (megatron-core 0.13+, NVML).

Each rank reads its own GPU's energy counter; ``lap()`` and ``get_total()`` then all-reduce the figures over the
world. Two things change once a rank is lost:

- ``training_log`` divides ``lap()``, now the survivors' sum, by ``args.world_size``: the live world's while it runs
  (``between_steps.live_world_size``), so the figure stays per live GPU;
- ``train()`` calls ``lap()`` and ``get_total()`` once more after its loop, outside every guarded call: a peer lost
  there would take the survivors with it before the final save. Both are guarded there (fault injection phase
  ``end``): recovered from, the monitor's counters put back as the call found them, and the call run again in the
  new layout. Inside ``training_log`` a redo of the whole log call puts the counters back the same way.

The energy a lost GPU drew is gone with its counter: the closing total counts the GPUs alive at the end.
"""
from __future__ import annotations

from typing import Any, Callable

from .between_steps import once_training

#: ``EnergyMonitor``'s running counters (mJ), which ``lap()`` advances before its all-reduce
COUNTERS = ("_total_energy", "_lap_energy", "_last_energy")


def keep_counters(monitor: Any, *args: Any, **kwargs: Any) -> Callable[[], None]:
    """What a redone ``lap()`` (or the ``training_log`` calling it) needs: the counters as they were."""
    saved = {name: getattr(monitor, name) for name in COUNTERS if hasattr(monitor, name)}

    def restore() -> None:
        for name, value in saved.items():
            setattr(monitor, name, value)

    return restore


def lap(original: Callable[..., Any]) -> Callable[..., Any]:
    return once_training("end", "the energy lap", keep=keep_counters)(original)


def get_total(original: Callable[..., Any]) -> Callable[..., Any]:
    return once_training("end", "the energy total")(original)


def monitor_counters() -> Callable[[], None]:
    """``keep_counters`` for the job's monitor, if ``--log-energy`` set one up (for ``training_log``'s redo)."""
    try:
        from megatron.training import get_args
        from megatron.training.global_vars import get_energy_monitor

        if not getattr(get_args(), "log_energy", False):
            return lambda: None
        return keep_counters(get_energy_monitor())
    except (ImportError, AssertionError, AttributeError):  # 0.12 has no monitor; not set up
        return lambda: None
