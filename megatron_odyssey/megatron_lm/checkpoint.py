"""Megatron checkpoints written after a recovery, in the job's original layout.

After the first failure ``parallel_state`` says every rank is pipeline rank 0 of 1 and data-parallel
rank 0 of 1 (pipelines and replicas are Odyssey's, see ``runtime.world``), and Megatron derives what a
rank writes from exactly those numbers: every holder of a layer would claim to be its main replica, and
every rank would write the RNG state of pipeline slot 0. In the ``torch_dist`` format a checkpoint is
layout-free (layers are stacked on a global axis), so it is enough to say who writes what:

- each unit (embedding, layer, output) is written by one holder, the lowest live node holding it (the
  unit's *owner*, the same one that counts it in the gradient norm); the other holders mark their
  copies as replicas (``replica_id`` != 0) so the writer's validation sees each element once;
- the RNG state keeps Megatron's global shape (original pipeline stages x TP): each slot is written by
  one live rank, the first surviving node of that original stage, or the owner of the stage's first
  layer when the whole stage is gone;
- the rerun state machine's per-rank state keeps the launch's world, or to core_r0.13.0 the RNG state's layout
  (:func:`original_layout_rerun_state`).

The legacy ``torch`` format names one file per pipeline rank and holds the whole stage's state in it; a
re-arranged job has no such files to write, so it is refused with ``--odyssey`` (see ``arguments``).
"""
from __future__ import annotations

import re
from typing import Any, Iterable

from ..planning.plan import ExecutionPlan

_LAYER_KEY = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)\.")


def sharded_unit(key: str, global_offset: tuple[int, ...], num_layers: int) -> int:
    """Unit of a sharded tensor or object of a GPT model by its checkpoint key: 0 embedding, 1..L
    layers, L+1 final norm and output (as ``runtime.grad_sync.unit_of``). Homogeneous layers are
    stacked (key ``decoder.layers.<name>``, the global layer on axis 0); others carry the layer in the key."""
    body = key.split("/", 1)[0]
    if body.startswith("embedding.") or ".embedding." in body:
        return 0
    m = _LAYER_KEY.search(body)
    if m:
        return int(m.group(1)) + 1
    if body.startswith("decoder.layers.") or ".decoder.layers." in body:
        return int(global_offset[0]) + 1
    return num_layers + 1


def _with_replica(replica_id: Any, index: int) -> Any:
    """``replica_id`` with its data-parallel component (the last; Megatron's layout) set to ``index``."""
    if isinstance(replica_id, tuple):
        return (*replica_id[:-1], index) if replica_id else (index,)
    return index


def mark_replicas(sharded: Iterable[Any], holders: dict[int, list[int]], node: int, num_layers: int,
                  unit_by_storage: dict[int, int] | None = None) -> None:
    """Set each sharded item's replica index to this node's position among the unit's holders (the
    owner, first, writes it).
    ``unit_by_storage`` (parameter data pointer -> unit) places items whose key alone does not say
    their layer (a ShardedTensorFactory, such as SwiGLU's split ``linear_fc1``, has no offsets yet)."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    for item in sharded:
        if not isinstance(item, ShardedBase):
            continue
        data = getattr(item, "data", None)
        ptr = data.data_ptr() if hasattr(data, "data_ptr") else None
        if unit_by_storage and ptr in unit_by_storage:
            unit = unit_by_storage[ptr]
        else:
            unit = sharded_unit(item.key, tuple(getattr(item, "global_offset", ()) or (0,)), num_layers)
        nodes = sorted(holders.get(unit, [node]))
        index = nodes.index(node) if node in nodes else len(nodes)
        item.replica_id = _with_replica(item.replica_id, index)


def rng_writers(plan: ExecutionPlan, launch: ExecutionPlan) -> dict[int, int]:
    """Original pipeline stage -> the live node that writes its RNG slot: the stage's first live node in the
    ``launch`` plan (generation 0's: node of stage s, replica d is s * dp + d, Megatron's rank order), else the
    lowest live holder of the stage's first layer in ``plan``."""
    live = set(plan.live_nodes())
    owners = {unit: min(nodes) for unit, nodes in plan.holders().items()}
    writers = {}
    for stage, first in enumerate(launch.pipelines[0].stages):
        alive = sorted(p.stages[stage].node for p in launch.pipelines if p.stages[stage].node in live)
        writers[stage] = alive[0] if alive else owners[first.layer_start + 1]
    return writers


def launch_rng_writers(runtime: Any) -> dict[int, int]:
    """:func:`rng_writers` of a running job's current plan, against its launch plan."""
    return rng_writers(runtime.plan, runtime.gen0_plan)


def stages_written(writers: dict[int, int], node: int) -> list[int]:
    """The original stages whose (stage, TP rank) slots ``node`` writes (``writers``: :func:`rng_writers`)."""
    return [stage for stage, writer in sorted(writers.items()) if writer == node]


def rng_state_objects(rng_state_list: Any, writers: dict[int, int], node: int, tp_rank: int, tp: int) -> list[Any]:
    """The ``rng_state`` entries this rank writes: one ShardedObject per original stage it writes, in
    Megatron's (stage, TP rank) layout, so a stock job at the original layout finds every slot."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    pp = len(writers)
    return [ShardedObject("rng_state", rng_state_list, (pp, tp), (stage, tp_rank), replica_id=0)
            for stage in stages_written(writers, node)]


def rewrite_sharded_state_dict(state_dict: dict, chunk: Any, runtime: Any) -> dict:
    """A model chunk's sharded state dict with replica ids for the runtime's plan (in place)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    from ..runtime.generation import node_stage
    from ..runtime.grad_sync import unit_of
    from ..runtime.model import to_global_name

    start, _ = node_stage(runtime.plan, runtime.node)
    layers = runtime.cfg.layers
    units = {p.data_ptr(): unit_of(to_global_name(name, start), layers) for name, p in chunk.named_parameters()}
    mark_replicas(nested_values(state_dict), runtime.plan.holders(), runtime.node, layers, units)
    return state_dict


def with_plan_replicas(chunk: Any, runtime: Any) -> Any:
    """``chunk.sharded_state_dict`` that marks replicas by the plan (installed on the instance for one save)."""
    original = type(chunk).sharded_state_dict.__get__(chunk)

    def sharded_state_dict(*args: Any, **kwargs: Any) -> dict:
        return rewrite_sharded_state_dict(original(*args, **kwargs), chunk, runtime)

    return sharded_state_dict


def original_layout_rng(sharded: Any, runtime: Any) -> list[Any]:
    """Megatron's ``rng_state`` ShardedObject (built from our one-rank parallel_state) -> the entries this
    rank writes in the original (stage x TP) layout."""
    data = getattr(sharded, "data", sharded)
    writers = launch_rng_writers(runtime)
    return rng_state_objects(data, writers, runtime.node, runtime.tp_rank, runtime.cfg.tp)


def rerun_state_slots(ident: int, live: list[int], launch_world: int) -> list[int]:
    """The launch ranks whose slot of the rerun state machine's per-rank state this rank writes (its own; the
    lowest live rank also the lost ranks')."""
    if ident != min(live):
        return [ident]
    return [ident, *(i for i in range(launch_world) if i not in live)]


def original_layout_rerun_state(state: Any, runtime: Any, loading: bool) -> Any:
    """Megatron's rerun state machine's checkpoint entry after a recovery, in the launch's layout: its per-rank
    ShardedObject is keyed by the world's size and this rank's place in it (core_r0.14.0 on; 0.18.0 on write it at
    every save, before only while a rerun is pending), so the survivors would write "shard_r_7" where a job
    relaunched at the original size reads "shard_r_8", and a restart from a checkpoint written before the failure
    would not find its slots. Each rank writes (and reads) the slot of its launch rank; the lowest live rank also
    writes the slots of the lost ranks, with its own rank-level state (theirs is gone with them). To core_r0.13.0 it
    is keyed by (pipeline stage, TP rank), written by data-parallel replica 0 at every save, like the RNG state:
    each slot is written by that stage's RNG writer (:func:`rng_writers`). ``loading``: a load checks the same
    access pattern as a save (every slot once), so a rank asks for the slots it would write, its launch rank's (or
    launch stage's) first, which is the one it loads (:func:`own_rerun_state`)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from ..planning.cluster import node_ranks

    sharded = state.get("sharded") if isinstance(state, dict) else None
    if not isinstance(sharded, ShardedObject):
        return state
    cfg = runtime.cfg
    if len(sharded.global_shape) == 2:  # (pipeline stages, TP ranks): to core_r0.13.0
        shape, own = (cfg.pp, cfg.tp), (runtime.node // cfg.dp, runtime.tp_rank)
        writers = launch_rng_writers(runtime)
        written = [(stage, runtime.tp_rank) for stage in stages_written(writers, runtime.node)]
    else:
        shape, own = (cfg.pp * cfg.dp * cfg.tp,), (runtime.ident,)
        live = node_ranks(runtime.rank_map.live_nodes, cfg.tp)
        written = [(slot,) for slot in rerun_state_slots(runtime.ident, live, shape[0])]
    slots = [own, *(s for s in written if s != own)] if loading else written
    state["sharded"] = [ShardedObject(sharded.key, sharded.data, shape, slot, replica_id=0 if slot in written else 1)
                        for slot in slots]
    return state


def own_rerun_state(state_dict: Any) -> Any:
    """A loaded rerun state machine entry whose per-rank part is the list :func:`original_layout_rerun_state` asked
    for: its first (this rank's launch slot), as Megatron's ``load_state_dict`` reads one."""
    if isinstance(state_dict, dict) and isinstance(state_dict.get("sharded"), list) and state_dict["sharded"]:
        return {**state_dict, "sharded": state_dict["sharded"][0]}
    return state_dict


__all__ = ["mark_replicas", "original_layout_rerun_state", "original_layout_rng", "own_rerun_state",
           "rerun_state_slots", "rewrite_sharded_state_dict", "rng_state_objects", "rng_writers", "sharded_unit",
           "stages_written", "with_plan_replicas"]



#: distributed-optimizer checkpoint formats a re-arranged job's optimizer reads (megatron_lm.replica_optimizer)
LAYOUT_FREE_OPTIMIZER_FORMATS = ("fully_reshardable",)


def optimizer_format(save_dir: str, iteration: int) -> str | None:
    """How the ``torch_dist`` checkpoint of ``iteration`` holds a distributed optimizer's state (its content
    metadata's ``distrib_optim_sharding_type``: ``dp_reshardable`` by Megatron's default, ``fully_reshardable``
    with ``--dist-ckpt-optim-fully-reshardable`` and after a failure); None if it cannot be read."""
    from pathlib import Path

    from torch.distributed.checkpoint.api import CheckpointException

    try:
        common = _common_state(Path(save_dir) / f"iter_{iteration:07d}")
    except (Exception, CheckpointException):  # unreadable (missing, not torch_dist): unknown (a BaseException)
        return None
    return ((common or {}).get("content_metadata") or {}).get("distrib_optim_sharding_type")


def unrecorded_optimizer_format(args: Any, version: Any) -> str | None:
    """The format this job's saves hold a distributed optimizer's state in, where its release does not record it in
    the checkpoint (core_r0.12.0's ``save_checkpoint``: ``fully_sharded_model_space``, ``dp_zero_gather_scatter``
    with ``--no-ckpt-fully-parallel-save``); None where the checkpoint says (``optimizer_format``)."""
    if version is None or version.records_optimizer_format or not getattr(args, "use_distributed_optimizer", False):
        return None
    if getattr(args, "ckpt_format", "torch_dist") != "torch_dist":
        return None
    return "fully_sharded_model_space" if getattr(args, "ckpt_fully_parallel_save", True) else "dp_zero_gather_scatter"


def load_in_one_process(state_dict: dict, directory: Any, **kwargs: Any) -> None:
    """``torch.distributed.checkpoint.load`` without a process group (the agent, the tests), quiet about it:
    torch warns on every such call that it assumes a single process, which is the point here."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(state_dict, storage_reader=dcp.FileSystemReader(str(directory)), no_dist=True, **kwargs)


#: where core_r0.19.0 on keeps a checkpoint's common state: one ShardedObject among the torch_dist files
COMMON_STATE_KEY = "common_state/shard_0_1"


def _common_state(directory: Any) -> dict:
    """A checkpoint's common (non-sharded) state: ``common.pt`` up to core_r0.18.0, the ShardedObject
    ``common_state`` from core_r0.19.0 on. Read here, not with ``dist_checkpointing.load_common_state_dict``: the
    agent reading it may have another megatron-core than the job that wrote it, or none, so a class the pickle
    names and this process cannot import (``args`` holds core_r0.19.0's enums) is read as a stand-in."""
    import io

    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    if (directory / "common.pt").exists():
        return torch.load(directory / "common.pt", map_location="cpu", weights_only=False, pickle_module=_Tolerant)

    class RawBytes(DefaultLoadPlanner):
        """Keeps the pickled item's bytes (the default planner unpickles them, with every class importable)."""

        raw = b""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            self.raw = value.read()  # one key is asked for, so one item comes

    if not (directory / ".metadata").exists():  # (torch would print its own traceback before raising)
        raise FileNotFoundError(f"{directory} is not a torch_dist checkpoint")
    planner = RawBytes(flatten_state_dict=False)
    load_in_one_process({COMMON_STATE_KEY: b""}, directory, planner=planner)
    return torch.load(io.BytesIO(planner.raw), map_location="cpu", weights_only=False,
                      pickle_module=_Tolerant)[0]


class _StandIn:
    """A class a checkpoint's pickle names that this process cannot import: takes whatever it is built from."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _Tolerant:
    """``pickle`` as ``torch.load`` uses it, with classes it cannot find read as :class:`_StandIn`."""

    import pickle as _pickle

    load = _pickle.load

    class Unpickler(_pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            try:
                return super().find_class(module, name)
            except (ImportError, AttributeError):
                return _StandIn
