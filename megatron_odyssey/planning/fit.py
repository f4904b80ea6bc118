"""Does a launch layout fit device memory, and if not, which layout would?

A user whose TP x PP x DP grid does not fit needs to know what to type instead, not only that it
failed: ``suggest_layout`` searches the grids of the same devices (then, if none fits, the smallest
model replica that does) with the memory estimator (Eq. 14), and ``explain_misfit`` words the answer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .estimator import estimate_step
from .partition import PipelineModel, remainder_placements, split_layers
from .plan import symmetric_plan
from .profile import ModelProfile

GiB = 2**30
TP_SIZES = (1, 2, 4, 8)  # one server's worth of tensor parallelism

ProfileForTp = Callable[[int], "ModelProfile | None"]  # None: this profile cannot be re-derived at that TP


@dataclass(frozen=True)
class Grid:
    tp: int
    pp: int
    dp: int

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp


def fits(profile: ModelProfile, pp: int, dp: int, num_micro_batches: int) -> bool:
    """Megatron's PP x DP grid with the estimator's layer split fits every device (Eq. 14 on the real
    1F1B in-flight counts)."""
    if pp > profile.num_layers or num_micro_batches % dp:
        return False
    m = num_micro_batches // dp
    split = split_layers(PipelineModel(profile, pipelines=dp), pp, m)
    if split is None:
        return False
    plan = symmetric_plan(pp, dp, profile.num_layers, num_micro_batches, layer_split=split)
    return estimate_step(plan, profile).fits_memory


def least_peak_bytes(profile: ModelProfile, pp: int, dp: int, micro_batches: int) -> int:
    """Memory of the fullest stage under the best placement of the layers: what a pipeline of ``dp`` needs."""
    model = PipelineModel(profile, pipelines=dp)
    return min(model.peak_bytes(split, micro_batches)
               for split in remainder_placements(profile.num_layers, pp) or [(profile.num_layers,)])


def suggest_layout(profile_for_tp: ProfileForTp, devices: int, num_micro_batches: int, dp_hint: int) -> Grid | None:
    """A grid that fits: on the same devices, the one with the smallest model replica (TP x PP; more
    data parallelism), else the smallest replica that fits at all, with DP near ``dp_hint``."""
    profiles = {tp: profile_for_tp(tp) for tp in TP_SIZES}
    profiles = {tp: p for tp, p in profiles.items() if p is not None}
    same: list[Grid] = []
    for tp, prof in profiles.items():
        if devices % tp:
            continue
        nodes = devices // tp
        same += [Grid(tp, pp, nodes // pp) for pp in range(1, min(nodes, prof.num_layers) + 1) if nodes % pp == 0]
    for g in sorted(same, key=lambda g: (g.tp * g.pp, g.tp)):
        if fits(profiles[g.tp], g.pp, g.dp, num_micro_batches):
            return g
    dp = max(d for d in range(1, max(1, dp_hint) + 1) if num_micro_batches % d == 0)
    replicas = sorted(((tp, pp) for tp, prof in profiles.items() for pp in range(1, prof.num_layers + 1)),
                      key=lambda x: (x[0] * x[1], x[0]))
    for tp, pp in replicas:
        if fits(profiles[tp], pp, dp, num_micro_batches):
            return Grid(tp, pp, dp)
    return None


def explain_misfit(profile: ModelProfile, grid: Grid, num_micro_batches: int, suggestion: Grid | None,
                   devices_flag: str, devices_of: Callable[[Grid], int], label: str | None = None) -> str:
    """One line: what does not fit, by how much, and what to type instead (``label``: the model as the
    user named it)."""
    need = least_peak_bytes(profile, grid.pp, grid.dp, max(1, num_micro_batches // grid.dp))
    have = profile.device_memory_bytes
    head = (f"--tp {grid.tp} --pp {grid.pp} --dp {grid.dp} does not fit {label or profile.name} in memory: its fullest "
            f"stage needs {need / GiB:.1f} GiB, a device has {have / GiB:.1f} GiB")
    if suggestion is None:
        return head + "; no layout up to TP 8 fits this model on these devices"
    flags = f"{devices_flag} {devices_of(suggestion)} --tp {suggestion.tp} --pp {suggestion.pp} --dp {suggestion.dp}"
    if suggestion.devices == grid.devices:
        return head + f"; a layout of the same {grid.devices} devices that fits: {flags}"
    return head + f"; no layout of {grid.devices} devices fits; the smallest that does: {flags}"
