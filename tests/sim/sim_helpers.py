"""Small, fast simulation settings shared by the simulator tests (imported by name: tests/ has no
packages, so pytest puts this folder on sys.path)."""
from __future__ import annotations

from megatron_odyssey.sim import SimulationConfig

SMALL = dict(npus=8, tp=1, pp=2, dp=4, model="llama2-7b", num_layers=8, global_batch=16, micro_batch=1,
             hours=3.0, seeds=2, progress=False)


def small_config(**overrides) -> SimulationConfig:
    kw = dict(SMALL)
    kw.update(overrides)
    return SimulationConfig(**kw)
