"""Training state by global parameter name: capture, restore, move between ranks, checkpoint.

State of one parameter shard = its fp32 value, Adam's two moments and Adam's step count. Names are
plan-independent (``decoder.layers.{k}.…``), so the same state fits any layout; a node that takes
over new layers receives exactly their state from a live holder along the restorer's transfer
schedule, and a restart reads it from the checkpoint files of whichever nodes wrote it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from .grad_sync import unit_of
from .transport import P2P

ParamState = dict[str, torch.Tensor | float]
State = dict[str, ParamState]  # global name -> state of this rank's shard

#: with tied embeddings the output layer's weight is a copy of the word embeddings (same values, same Adam
#: state), and a stage holding both ends has only the embedding: a transfer of the output unit names the copy
#: on both sides whichever of the two each side holds
TIED_ALIASES = {"output_layer.weight": "embedding.word_embeddings.weight"}


def capture(named_params: Iterable[tuple[str, torch.nn.Parameter]], optimizer: torch.optim.Optimizer) -> State:
    out: State = {}
    for name, p in named_params:
        st = optimizer.state.get(p, {})
        out[name] = {
            "param": p.detach().clone(),
            "exp_avg": st["exp_avg"].detach().clone() if "exp_avg" in st else torch.zeros_like(p),
            "exp_avg_sq": st["exp_avg_sq"].detach().clone() if "exp_avg_sq" in st else torch.zeros_like(p),
            "step": float(st["step"]) if "step" in st else 0.0,
        }
    return out


@torch.no_grad()
def restore(named_params: Iterable[tuple[str, torch.nn.Parameter]], optimizer: torch.optim.Optimizer,
            state: State, strict: bool = True) -> list[str]:
    """Copy values and Adam state into a (new) model and its optimizer; returns missing names."""
    missing = []
    for name, p in named_params:
        st = state.get(name)
        if st is None:
            missing.append(name)
            continue
        p.copy_(st["param"])
        if st["step"] > 0:
            optimizer.state[p] = adam_state(st["step"], st["exp_avg"], st["exp_avg_sq"], p.device)
    if strict and missing:
        raise KeyError(f"no state for {missing}")
    return missing


def adam_state(step: float, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, device: torch.device | str) -> ParamState:
    """torch's Adam state of a parameter on ``device``: the step on the host (unless capturable/fused), copies of
    the moments beside the parameter."""
    return {"step": torch.tensor(float(step)), "exp_avg": exp_avg.to(device, copy=True),
            "exp_avg_sq": exp_avg_sq.to(device, copy=True)}


def transfer(transfers: list[tuple[int, int, int]], my_node: int, tp_rank: int, rank_of, num_layers: int,
             old: State, wanted: dict[str, torch.Size], device: torch.device | str = "cpu",
             p2p: P2P | None = None, aliases: dict[str, str] | None = None) -> State:
    """Move unit states along the schedule ``[(unit, src node, dst node), ...]`` (same order on every
    rank). Each TP rank moves its own shards. All sends are posted before any receive, so no order
    of roles can deadlock. Messages carry no tags (NCCL ignores them): between two nodes, units go in
    schedule order and a unit's tensors in sorted-name order, the same on both sides. ``wanted``
    gives the shapes of this rank's new parameters; received state lands on ``device``. ``aliases``
    (name -> the name of the parameter it copies, :data:`TIED_ALIASES`): a side holding only the copied
    parameter sends (or receives) it under the alias too."""
    p2p = p2p or P2P()
    aliases = aliases or {}
    old = {**{a: old[t] for a, t in aliases.items() if a not in old and t in old}, **old}
    wanted = {**{a: wanted[t] for a, t in aliases.items() if a not in wanted and t in wanted}, **wanted}
    sends, received = [], {}
    plan = list(transfers)
    for unit, src, dst in plan:
        if src != my_node:
            continue
        names = sorted(n for n in old if unit_of(n, num_layers) == unit)
        for t in _flatten(old, names):
            sends.append(p2p.isend(t, rank_of(dst, tp_rank)))
    for unit, src, dst in plan:
        if dst != my_node:
            continue
        names = sorted(n for n in wanted if unit_of(n, num_layers) == unit)
        for name in names:
            p, m, v = (p2p.recv(torch.empty(wanted[name], device=device), rank_of(src, tp_rank)) for _ in range(3))
            step = p2p.recv(torch.empty(1, dtype=torch.float64, device=device), rank_of(src, tp_rank))
            received[name] = {"param": p, "exp_avg": m, "exp_avg_sq": v, "step": float(step.item())}
    for work in sends:
        work.wait()
    return received


def _flatten(state: State, names: list[str]) -> list[torch.Tensor]:
    out = []
    for name in names:
        st = state[name]
        param = st["param"]
        out += [param.contiguous(), st["exp_avg"].contiguous(), st["exp_avg_sq"].contiguous(),
                torch.tensor([float(st["step"])], dtype=torch.float64, device=param.device)]
    return out


# -- checkpoints ----------------------------------------------------------------------------------


def checkpoint_path(root: str | Path, step: int, node: int, tp_rank: int) -> Path:
    return Path(root) / f"step{step:06d}" / f"node{node}_tp{tp_rank}.pt"


def save_checkpoint(root: str | Path, step: int, node: int, tp_rank: int, state: State) -> Path:
    path = checkpoint_path(root, step, node, tp_rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.rename(path)  # a reader never sees half a file
    return path


def load_checkpoint(root: str | Path, step: int, tp_rank: int, names: Iterable[str],
                    device: torch.device | str = "cpu") -> State:
    """Gather the named shards of ``tp_rank`` from every node's file of checkpoint ``step``."""
    wanted = set(names)
    out: State = {}
    for path in sorted((Path(root) / f"step{step:06d}").glob(f"node*_tp{tp_rank}.pt")):
        part = torch.load(path, weights_only=False, map_location=device)
        for name in wanted & set(part) - set(out):
            out[name] = part[name]
    missing = wanted - set(out)
    if missing:
        raise FileNotFoundError(f"checkpoint step {step} lacks {sorted(missing)[:5]}...")
    return out
