"""Megatron's optimizer of a rebuilt stage, sharded over each unit's holders with a replica of every shard.

A job that ran Megatron's distributed optimizer keeps its optimizer state sharded after a failure. Megatron's
flat-buffer sharding cannot follow an asymmetric plan (each layer lives on its own set of ranks), so the
stage is built with Megatron's plain optimizer (``get_megatron_optimizer``: its parameter groups, its
``Float16OptimizerWithFloat16Params`` or ``FP32Optimizer``, its clipping, its step) and then cut down:
every parameter of a unit is split into one contiguous shard per holder of the unit, and this rank keeps
only the shards ``planning.sharding.kept_shards`` gives it (its own and the next holder's, like MindSpeed's
replica optimizer). Megatron's optimizer then steps *shard parameters*: views of the model parameter (and
of its ``main_grad``) over the kept range, with fp32 main copies and Adam moments of that range only. Adam
is elementwise, so a shard's update is the plain optimizer's update of those elements (the plan-wide
gradient norm is the whole model's, as before). After the committed step every holder all-gathers the
shards it owns into the full model parameters (:meth:`ReplicaShards.gather_params`). With tied embeddings the
shared weight (a first stage's word embeddings, a last stage's copy, or the one weight of a stage holding both
ends) is sharded the same way over every holder of either end, as the pseudo-unit :data:`TIED_UNIT`: every copy
takes the same step (``grad_sync`` sums the gradient over all of them), so one sharding serves them all.

Static memory per parameter of a unit with h holders: 2 (bf16 weight) + 4 (fp32 gradient buffer) +
12 x min(2, h) / h, against 18 for the plain optimizer. Transient: Megatron builds the plain optimizer's fp32
main copies (4 bytes per parameter) before they are cut, and a recovery assembles the stage's full state on
the host before restoring the kept shards from it. A failure keeps the pieces (:meth:`capture`); the next
generation's live keepers exchange them (``distributed_optimizer.reassemble``). Checkpoints are written (and
read) in the distributed optimizer's layout-free ``fully_reshardable`` format, so the job's own command line
relaunches from them: the full state is gathered for the call (a transient full copy while a checkpoint is
written).
"""
from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Collection

import torch
import torch.distributed as dist

from ..planning.sharding import kept_shards, shard_bounds
from ..runtime.grad_sync import unit_of
from ..runtime.state import adam_state
from .distributed_optimizer import ShardedState, host_piece
from .hooks import sub_optimizers


#: the shard key of the tied embedding weight (``planning.sharding.tied_holders``), beside the units 0..L+1
TIED_UNIT = -1


def supported() -> bool:
    """Whether this megatron-core's distributed optimizer reads the layout-free ``fully_reshardable`` format the
    cut-down optimizer writes its checkpoints in (0.15+); older releases run Megatron's plain optimizer after a
    failure instead."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return "fully_reshardable" in getattr(DistributedOptimizer, "checkpoint_fully_reshardable_formats", ())


@dataclass
class Slice:
    """One kept range ``[start, end)`` of a flattened model parameter and what Megatron's optimizer steps."""

    name: str
    start: int
    end: int
    view: torch.nn.Parameter  # the model parameter's elements (its storage), with ``main_grad`` over the range
    main: torch.nn.Parameter  # what the torch optimizer updates: an fp32 copy (bf16), or ``view`` itself (fp32)
    torch_optimizer: torch.optim.Optimizer


@dataclass
class Holding:
    """A model parameter of this rank's stage and how its unit is sharded."""

    name: str
    param: torch.nn.Parameter
    unit: int
    ranks: list[int]  # the unit's holders (this tensor-parallel rank's), in plan order: shard i is owned by ranks[i]
    position: int
    bounds: list[tuple[int, int]] = dataclasses.field(init=False)  # every holder's shard, by position

    def __post_init__(self) -> None:
        self.bounds = shard_bounds(self.param.numel(), len(self.ranks))


class ReplicaShards:
    """Cuts a Megatron optimizer built over the full stage down to this rank's shards, and moves state in and
    out of it (restore, capture, checkpoint, the parameter all-gather)."""

    def __init__(self, megatron_optimizer: Any, named: list[tuple[str, torch.nn.Parameter]],
                 unit_groups: dict[int, tuple[Any, list[int]]], my_rank: int, num_layers: int, copies: int,
                 staged: bool = False, tied_names: Collection[str] = (),
                 tied_group: tuple[Any, list[int]] | None = None):
        """``tied_names``: with tied embeddings, the names this stage's copy of the shared weight may have; it
        is sharded over ``tied_group`` (every holder of either end, ``PlanGroups.tied_group``; None: this rank
        is the only one) as the pseudo-unit :data:`TIED_UNIT`, since a stage holding both ends has one weight
        for the two units."""
        self.copies, self.staged = copies, staged
        self.unit_groups = dict(unit_groups)
        if tied_group is not None:
            self.unit_groups[TIED_UNIT] = tied_group
        self.optimizers = sub_optimizers(megatron_optimizer)
        self.holdings: dict[str, Holding] = {}
        name_of = {id(p): n for n, p in named}
        for n, p in named:
            unit = TIED_UNIT if n in tied_names else unit_of(n, num_layers)
            ranks = list(self.unit_groups[unit][1]) if unit in self.unit_groups else [my_rank]
            self.holdings[n] = Holding(n, p, unit, ranks, ranks.index(my_rank))
        # the units more than one rank holds, with their parameters (what the collectives run over)
        self.shared: dict[int, list[Holding]] = defaultdict(list)
        for h in self.holdings.values():
            if len(h.ranks) > 1:
                self.shared[h.unit].append(h)
        self.slices: dict[str, list[Slice]] = defaultdict(list)
        self.full_groups: list[tuple[Any, list[list[torch.nn.Parameter]]]] = []  # per optimizer: model params by group
        for opt in self.optimizers:
            self._cut(opt, name_of)

    # -- building ----------------------------------------------------------------------------------
    def _ranges(self, holding: Holding) -> list[tuple[int, int]]:
        """The kept shards as contiguous ranges (neighbouring shards merged), without empty ones."""
        bounds = holding.bounds
        out: list[list[int]] = []
        for k in sorted(kept_shards(holding.position, len(holding.ranks), self.copies)):
            a, b = bounds[k]
            if a == b:
                continue
            if out and out[-1][1] == a:
                out[-1][1] = b
            else:
                out.append([a, b])
        return [(a, b) for a, b in out]

    @torch.no_grad()
    def _cut(self, opt: Any, name_of: dict[int, str]) -> None:
        from megatron.core.tensor_parallel import copy_tensor_model_parallel_attributes

        torch_opt = opt.optimizer
        mixed = hasattr(opt, "float16_groups")
        full_models: list[list[torch.nn.Parameter]] = []
        for g, group in enumerate(torch_opt.param_groups):
            if mixed:  # Float16OptimizerWithFloat16Params: (model, fp32 main) pairs, then the fp32 model params
                pairs = list(zip(opt.float16_groups[g], opt.fp32_from_float16_groups[g]))
                fp32_models = list(opt.fp32_from_fp32_groups[g])
            else:  # FP32Optimizer: the torch optimizer steps the model parameters themselves
                pairs, fp32_models = [], list(group["params"])
            full_models.append([m for m, _ in pairs] + fp32_models)
            new_f16, new_main, new_fp32 = [], [], []
            for model, main in pairs:
                for a, b in self._ranges(self.holdings[name_of[id(model)]]):
                    view = self._view(model, a, b)
                    shard = torch.nn.Parameter(main.detach().view(-1)[a:b].clone())
                    copy_tensor_model_parallel_attributes(shard, model)
                    new_f16.append(view)
                    new_main.append(shard)
                    self.slices[name_of[id(model)]].append(Slice(name_of[id(model)], a, b, view, shard, torch_opt))
                if hasattr(model, "main_param"):
                    del model.main_param  # the full fp32 copy goes
            for model in fp32_models:
                for a, b in self._ranges(self.holdings[name_of[id(model)]]):
                    view = self._view(model, a, b)
                    copy_tensor_model_parallel_attributes(view, model)
                    new_fp32.append(view)
                    self.slices[name_of[id(model)]].append(Slice(name_of[id(model)], a, b, view, view, torch_opt))
            group["params"] = new_main + new_fp32
            if mixed:
                opt.float16_groups[g], opt.fp32_from_float16_groups[g], opt.fp32_from_fp32_groups[g] = (
                    new_f16, new_main, new_fp32)
        self.full_groups.append((opt, full_models))
        opt.sharded_state_dict = functools.partial(self._sharded_state_dict, opt)
        opt.load_state_dict = functools.partial(self._load_state_dict, opt)
        opt.state_dict = functools.partial(self._state_dict, opt)

    @staticmethod
    def _view(model: torch.nn.Parameter, a: int, b: int) -> torch.nn.Parameter:
        """A parameter over elements [a, b) of ``model`` (shared storage) with the same range of its main_grad."""
        view = torch.nn.Parameter(model.detach().view(-1)[a:b], requires_grad=model.requires_grad)
        grad = getattr(model, "main_grad", None)
        if grad is not None:
            view.main_grad = grad.view(-1)[a:b]
        return view

    # -- state in and out ------------------------------------------------------------------------------
    def kept_numel(self) -> int:
        """Elements of optimizer state this rank keeps (each with an fp32 value and two moments)."""
        return sum(s.end - s.start for slices in self.slices.values() for s in slices)

    @torch.no_grad()
    def restore(self, state: dict[str, dict[str, Any]], weights: bool = True) -> None:
        """Full per-parameter state (``runtime.state`` format) -> the kept shards, and the model parameters
        (``weights``; every holder writes the whole value, so no gather is needed)."""
        missing = [n for n in self.holdings if n not in state]
        if missing:
            raise KeyError(f"no state for {missing}")
        for name, holding in self.holdings.items():
            st = state[name]
            if weights:
                holding.param.copy_(st["param"])
            for s in self.slices[name]:
                s.main.copy_(st["param"].reshape(-1)[s.start:s.end])
                if st["step"] > 0:
                    s.torch_optimizer.state[s.main] = adam_state(
                        st["step"], st["exp_avg"].reshape(-1)[s.start:s.end], st["exp_avg_sq"].reshape(-1)[s.start:s.end],
                        s.main.device)
                else:
                    s.torch_optimizer.state.pop(s.main, None)

    def capture(self, plan: Any) -> ShardedState:
        """This rank's pieces (host copies) for the next generation's reassembly; ``plan``: the layout they are in."""
        out = ShardedState({n: (h.param.numel(), tuple(h.param.shape)) for n, h in self.holdings.items()}, plan)
        for name, slices in self.slices.items():
            out[name] = [host_piece(s.start, s.end, self.holdings[name].param, s.main,
                                    s.torch_optimizer.state.get(s.main, {})) for s in slices]
        return out

    # -- collectives over each unit's holders ----------------------------------------------------------------
    @torch.no_grad()
    def _all_gather_owned(self, unit: int, holdings: list[Holding], fields: list[Callable[[Holding], torch.Tensor]],
                          ) -> list[list[torch.Tensor]]:
        """For each of ``fields`` (a full flat tensor per holding, filled at least over this rank's own
        shard), every holder's own shard of every holding of ``unit``, gathered: the full tensors, per field."""
        group, ranks = self.unit_groups[unit]
        h, me = len(ranks), holdings[0].position
        sizes = [sum(b - a for a, b in (x.bounds[j] for x in holdings)) for j in range(h)]
        longest = max(sizes)
        first = fields[0](holdings[0])
        dtype, device = first.dtype, first.device
        mine = torch.zeros(len(fields), longest, dtype=dtype, device=device)
        for i, f in enumerate(fields):
            offset = 0
            for x in holdings:
                a, b = x.bounds[me]
                mine[i, offset:offset + b - a] = f(x).reshape(-1)[a:b]
                offset += b - a
        wire = mine.cpu() if self.staged and mine.device.type != "cpu" else mine
        parts = [torch.empty_like(wire) for _ in range(h)]
        dist.all_gather(parts, wire, group=group)
        out = []
        for i, f in enumerate(fields):
            fulls = [torch.empty(x.param.numel(), dtype=dtype, device=device) for x in holdings]
            for j in range(h):
                offset = 0
                for x, full in zip(holdings, fulls):
                    a, b = x.bounds[j]
                    full[a:b] = parts[j][i, offset:offset + b - a].to(device)
                    offset += b - a
            out.append(fulls)
        return out

    @torch.no_grad()
    def gather_params(self) -> None:
        """After the step: every holder's owned shard of the model parameters, to every holder of the unit
        (a collective per shared unit, in ascending unit order on every rank)."""
        for unit, holdings in sorted(self.shared.items()):
            (fulls,) = self._all_gather_owned(unit, holdings, [lambda x: x.param.detach()])
            for x, full in zip(holdings, fulls):
                x.param.view(-1).copy_(full)

    @torch.no_grad()
    def full_state(self) -> dict[str, dict[str, Any]]:
        """The whole state of every parameter of this rank's stage, gathered from the holders (collective)."""
        local = self._local_full()
        out = {n: dict(v) for n, v in local.items()}
        for unit, holdings in sorted(self.shared.items()):
            keys = ("param", "exp_avg", "exp_avg_sq")
            gathered = self._all_gather_owned(unit, holdings, [lambda x, k=k: local[x.name][k] for k in keys])
            for k, fulls in zip(keys, gathered):
                for x, full in zip(holdings, fulls):
                    out[x.name][k] = full.view(x.param.shape)
        return out

    def _local_full(self) -> dict[str, dict[str, Any]]:
        """Full-size fp32 tensors holding this rank's kept ranges (zeros elsewhere)."""
        out = {}
        for name, h in self.holdings.items():
            full = {k: torch.zeros(h.param.numel(), dtype=torch.float32, device=h.param.device)
                    for k in ("param", "exp_avg", "exp_avg_sq")}
            step = 0.0
            for s in self.slices[name]:
                st = s.torch_optimizer.state.get(s.main, {})
                full["param"][s.start:s.end] = s.main.detach().reshape(-1)
                for k in ("exp_avg", "exp_avg_sq"):
                    if k in st:
                        full[k][s.start:s.end] = st[k].reshape(-1)
                step = float(st["step"]) if "step" in st else step
            out[name] = {**full, "step": step}
        return out

    # -- Megatron's checkpointing, in the distributed optimizer's layout-free format ----------------------------
    def _sharded_state_dict(self, opt: Any, model_sharded_state_dict: Any, is_loading: bool = False,
                            **kwargs: Any) -> dict[str, Any]:
        """What Megatron's ``DistributedOptimizer.sharded_state_dict`` writes in its ``fully_reshardable``
        format: per model parameter its fp32 value and Adam moments at the parameter's shape, under keys
        ``optimizer.state.{param,exp_avg,exp_avg_sq}.<the parameter's key>`` (replicas as the model's), with the
        parameter groups (and the step) beside. Any layout, and a relaunch of the job's own command line
        (``--use-distributed-optimizer``), loads it. Saving gathers the full state (a collective)."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
        from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

        tensors, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
        metadata = {id(sh.data): sh for sh in nested_values(tensors)}
        full = None if is_loading else self.full_state()
        param_state: dict[int, dict[str, Any]] = {}
        for i, holding in enumerate(self._holdings_of(opt)):
            sh = metadata.get(id(holding.param))
            if sh is None:
                raise ValueError(f"{holding.name} is not in the model's sharded state dict (built with keep_vars?)")
            entry = {}
            for key in ("param", "exp_avg", "exp_avg_sq"):
                data = (torch.empty(sh.data.shape, dtype=torch.float32, device=holding.param.device) if full is None
                        else full[holding.name][key].reshape(sh.data.shape))
                extra = {} if isinstance(sh, ShardedTensorFactory) else {"dtype": data.dtype}
                entry[key] = dataclasses.replace(sh, key=f"optimizer.state.{key}.{sh.key}", data=data,
                                                 replica_id=sh.replica_id, **extra)
            param_state[i] = entry
        steps = {float(s.torch_optimizer.state[s.main]["step"]) for slices in self.slices.values() for s in slices
                 if s.torch_optimizer is opt.optimizer and "step" in s.torch_optimizer.state.get(s.main, {})}
        if len(steps) > 1:
            raise RuntimeError(f"the kept shards disagree on Adam's step count {sorted(steps)}")
        # (DistributedOptimizer.state_dict keeps the groups without their parameters, each with the step)
        groups = [{k: v for k, v in group.items() if k != "params"} | ({"step": min(steps)} if steps else {})
                  for group in opt.optimizer.param_groups]
        return {"optimizer": {"param_groups": groups}, "param_state": param_state,
                "param_state_sharding_type": "fully_reshardable"}

    def _state_dict(self, opt: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("a job that ran the distributed optimizer saves torch_dist checkpoints only "
                                  "(--ckpt-format torch_dist) after a failure")

    def _load_state_dict(self, opt: Any, state_dict: dict[str, Any]) -> None:
        """A ``fully_reshardable`` checkpoint (filled into :meth:`_sharded_state_dict`'s template) into the kept
        shards; Megatron loads the model weights into the parameters itself."""
        kind = state_dict.get("param_state_sharding_type")
        if kind != "fully_reshardable":
            raise ValueError(f"this checkpoint holds the distributed optimizer's state as {kind!r}, which depends on "
                             f"the layout that wrote it; only 'fully_reshardable' (--dist-ckpt-optim-fully-reshardable) "
                             f"loads into a re-arranged job")
        step = max((float(g.get("step", 0.0)) for g in state_dict["optimizer"]["param_groups"]), default=0.0)
        state = {}
        for i, holding in enumerate(self._holdings_of(opt)):
            entry = state_dict["param_state"][i]
            state[holding.name] = {k: entry[k] for k in ("param", "exp_avg", "exp_avg_sq")} | {"step": step}
        self.restore(state, weights=False)

    def _holdings_of(self, opt: Any) -> list[Holding]:
        """The model parameters ``opt`` steps, in one order (its groups')."""
        full_models = next(models for o, models in self.full_groups if o is opt)
        by_param = {id(h.param): h for h in self.holdings.values()}
        return [by_param[id(m)] for models in full_models for m in models]

