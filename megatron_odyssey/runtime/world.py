"""The communication world of one plan: which process is which node, and the groups each rank needs.

A world is built per *generation* (the initial launch, then once per recovery) over the live nodes
only, so a plan with dead nodes needs no placeholder processes: world rank = (index of the node among
the plan's live nodes) x TP + tp_rank. Groups are created by every rank in the same deterministic
order (``torch.distributed.new_group`` is collective over the world), one per distinct rank set, and
megatron-core's ``parallel_state`` globals are pointed at them so code inside the model sees a
consistent world even when pipelines have different lengths (``initialize_model_parallel`` can only
express uniform grids).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from ..planning.plan import ExecutionPlan
from ..planning.sharding import tied_holders


@dataclass(frozen=True)
class RankMap:
    """node <-> world rank for one generation of a plan."""

    live_nodes: tuple[int, ...]
    tp: int

    @classmethod
    def for_plan(cls, plan: ExecutionPlan, tp: int) -> "RankMap":
        return cls(tuple(plan.live_nodes()), tp)

    @property
    def world_size(self) -> int:
        return len(self.live_nodes) * self.tp

    def rank(self, node: int, tp_rank: int) -> int:
        return self.live_nodes.index(node) * self.tp + tp_rank

    def node(self, rank: int) -> int:
        return self.live_nodes[rank // self.tp]

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def node_ranks(self, node: int) -> list[int]:
        return [self.rank(node, t) for t in range(self.tp)]


@dataclass
class PlanGroups:
    """What one rank needs to run its part of a plan."""

    rank_map: RankMap
    node: int
    tp_rank: int
    tp_group: dist.ProcessGroup | None
    # unit -> (group, member ranks) for every unit this rank holds that more than one node holds
    unit_groups: dict[int, tuple[dist.ProcessGroup, list[int]]] = field(default_factory=dict)
    self_group: dist.ProcessGroup | None = None
    # tied embeddings: (group, member ranks) of every holder of the embedding or the output layer, when this rank
    # is one and there are two or more (the pair's gradients are summed over all of them)
    tied_group: tuple[dist.ProcessGroup, list[int]] | None = None


def init_world(store: dist.Store, generation: int, rank: int, world_size: int, backend: str,
               timeout_s: float = 60.0) -> None:
    """Join generation ``generation``'s world through a fresh key prefix of the agent's store."""
    prefixed = dist.PrefixStore(f"odyssey/gen{generation}/", store)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def build_plan_groups(plan: ExecutionPlan, rank_map: RankMap, my_rank: int, tied: bool = False) -> PlanGroups:
    """Create (collectively, in the same order on every rank) the TP groups and the per-unit
    gradient-sync groups of ``plan`` (``tied``: and the tied embeddings' group), and return this rank's handles."""
    node, tp_rank = rank_map.node(my_rank), rank_map.tp_rank(my_rank)
    groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}

    def group(ranks: list[int]) -> dist.ProcessGroup | None:
        key = tuple(sorted(ranks))
        if key not in groups:
            groups[key] = dist.new_group(list(key)) if rank_map.world_size > 1 else dist.group.WORLD
        return groups[key]

    # 1. TP groups, one per live node (every rank takes part in every creation); with TP=1 a node's
    #    group is the rank itself, created locally below (N collective creations saved per recovery)
    tp_groups = {n: group(rank_map.node_ranks(n)) for n in rank_map.live_nodes} if rank_map.tp > 1 else {}
    def per_tp(nodes: list[int]) -> list[list[int]]:
        """One group of ``nodes``' ranks per TP rank, created now (collectively)."""
        out = [[rank_map.rank(n, t) for n in nodes] for t in range(rank_map.tp)]
        for ranks in out:
            group(ranks)
        return out

    def of_mine(per_tp_ranks: list[list[int]]) -> tuple[dist.ProcessGroup, list[int]] | None:
        ranks = per_tp_ranks[tp_rank]
        return (groups[tuple(sorted(ranks))], ranks) if my_rank in ranks else None

    # 2. gradient-sync groups: for each unit held by >= 2 nodes, one group per TP rank
    holders = plan.holders()
    unit_ranks = {unit: per_tp(holders[unit]) for unit in sorted(holders) if len(holders[unit]) >= 2}
    # 3. tied embeddings: every node holding the embedding or the output layer, one group per TP rank
    ends = tied_holders(holders, plan.num_layers) if tied else []
    tied_ranks = per_tp(ends) if len(ends) >= 2 else None
    # 4. a group of just this rank for megatron's data/pipeline/context groups, which our own
    #    executor replaces (each rank creates only its own, hence local synchronisation)
    me = dist.new_group([my_rank], use_local_synchronization=True) if rank_map.world_size > 1 else dist.group.WORLD
    mine = {unit: g for unit, g in ((u, of_mine(r)) for u, r in unit_ranks.items()) if g is not None}
    tied_group = of_mine(tied_ranks) if tied_ranks else None
    return PlanGroups(rank_map, node, tp_rank, tp_groups.get(node, me), mine, me, tied_group)


# -- megatron-core's parallel_state ----------------------------------------------------------------

# (global name, what we set it to); names follow megatron-core 0.12-0.16's parallel_state.
def install_parallel_state(groups: PlanGroups) -> None:
    """Point megatron-core's parallel_state at this plan's groups (replaces
    ``parallel_state.initialize_model_parallel``, which only builds uniform TP x PP x DP grids)."""
    from megatron.core import parallel_state as ps

    tp_ranks = groups.rank_map.node_ranks(groups.node)
    me = [dist.get_rank()]
    values = {
        "_TENSOR_MODEL_PARALLEL_GROUP": groups.tp_group,
        "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": tp_ranks,
        "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE": len(tp_ranks),
        "_MPU_TENSOR_MODEL_PARALLEL_RANK": groups.tp_rank,
        "_MODEL_PARALLEL_GROUP": groups.tp_group,
        "_MODEL_PARALLEL_GLOBAL_RANKS": tp_ranks,
        "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": groups.tp_group,
        # pipeline, data and context parallelism are ours (executor, per-unit sync): megatron sees
        # a world of one along those dimensions
        "_PIPELINE_MODEL_PARALLEL_GROUP": groups.self_group,
        "_PIPELINE_GLOBAL_RANKS": me,
        "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE": 1,
        "_MPU_PIPELINE_MODEL_PARALLEL_RANK": 0,
        "_DATA_PARALLEL_GROUP": groups.self_group,
        "_DATA_PARALLEL_GROUP_GLOO": groups.self_group,
        "_DATA_PARALLEL_GLOBAL_RANKS": me,
        "_DATA_PARALLEL_GROUP_WITH_CP": groups.self_group,
        "_DATA_PARALLEL_GROUP_WITH_CP_GLOO": groups.self_group,
        "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": me,
        "_MPU_DATA_PARALLEL_WORLD_SIZE": 1,
        "_MPU_DATA_PARALLEL_RANK": 0,
        "_CONTEXT_PARALLEL_GROUP": groups.self_group,
        "_CONTEXT_PARALLEL_GLOBAL_RANKS": me,
        "_TENSOR_AND_DATA_PARALLEL_GROUP": groups.tp_group,
        "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": groups.tp_group,
        "_EMBEDDING_GROUP": groups.self_group,
        "_EMBEDDING_GLOBAL_RANKS": me,
        "_POSITION_EMBEDDING_GROUP": groups.self_group,
        "_POSITION_EMBEDDING_GLOBAL_RANKS": me,
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": groups.self_group,
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": groups.self_group,
        "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": groups.self_group,
        # dense models: experts are absent, but Megatron's DDP and optimizer set-up look the groups up
        "_EXPERT_MODEL_PARALLEL_GROUP": groups.self_group,
        "_EXPERT_MODEL_PARALLEL_RANKS": me,
        "_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE": 1,
        "_MPU_EXPERT_MODEL_PARALLEL_RANK": 0,
        "_EXPERT_TENSOR_PARALLEL_GROUP": groups.tp_group,
        "_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE": len(tp_ranks),
        "_MPU_EXPERT_TENSOR_PARALLEL_RANK": groups.tp_rank,
        "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": groups.tp_group,
        "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": groups.tp_group,
        "_EXPERT_DATA_PARALLEL_GROUP": groups.self_group,
        "_EXPERT_DATA_PARALLEL_GROUP_GLOO": groups.self_group,
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": groups.self_group,
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO": groups.self_group,
        # megatron-core 0.19+: weight-rematerialising TP ("GTP remat", refused with --odyssey) is size 1,
        # where Megatron makes each *_WITH_* group equal to its plain one
        "_GTP_WEIGHT_REMAT_GROUP": groups.self_group,
        "_GTP_WEIGHT_REMAT_GLOBAL_RANKS": me,
        "_EXPERT_GTP_WEIGHT_REMAT_GROUP": groups.self_group,
        "_EXPERT_GTP_WEIGHT_REMAT_GLOBAL_RANKS": me,
        "_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": groups.self_group,
        "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": groups.self_group,
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": groups.self_group,
        "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": groups.self_group,
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": groups.self_group,
        "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP": groups.tp_group,
    }
    for name, value in values.items():
        if hasattr(ps, name):
            setattr(ps, name, value)
    if getattr(ps, "_GLOBAL_MEMORY_BUFFER", None) is None:
        ps._set_global_memory_buffer()


def peer_pairs(plan: ExecutionPlan, rank_map: RankMap, transfers: list[tuple[int, int, int]] = ()) -> list[tuple[int, int]]:
    """Every pair of world ranks that exchange point-to-point messages in ``plan`` (pipeline neighbours,
    rerouted work, state transfers), as sorted (low, high) rank pairs in one global order."""
    from ..planning.schedule import pair_messages

    nodes = set(pair_messages(plan)) | {(src, dst) for _, src, dst in transfers}
    pairs = set()
    for a, b in nodes:
        for t in range(rank_map.tp):
            ra, rb = rank_map.rank(a, t), rank_map.rank(b, t)
            pairs.add((min(ra, rb), max(ra, rb)))
    return sorted(pairs)


def connect_peers(pairs: list[tuple[int, int]], my_rank: int, p2p, device) -> None:
    """Open every point-to-point connection of this rank before the first real message, in the same
    global order on every rank. NCCL/HCCL create a pair's communicator on its first send/recv and both
    sides block until the other joins; created lazily in each rank's own order, two ranks can each wait
    for a third in a cycle. In one global order the first unfinished pair always has both ranks at it,
    so every pair completes."""
    import torch

    token = torch.zeros(1, device=device)
    for low, high in pairs:
        if my_rank == low:
            p2p.isend(token, high).wait()
            p2p.recv(token, high)
        elif my_rank == high:
            p2p.recv(token, low)
            p2p.isend(token, low).wait()


def abort_all_groups() -> None:
    """Abort every process group of this rank (closes its connections at once; the cascade that lets
    every survivor notice a failure in milliseconds instead of waiting out a timeout)."""
    from torch.distributed import distributed_c10d as c10d

    for pg in list(getattr(c10d._world, "pg_map", {}).keys()):
        try:
            pg.abort()
        except Exception:  # already aborted, or a backend without abort
            pass


def holds_gloo_groups(backend: str) -> bool:
    """Whether this rank (its world on ``backend``) holds a gloo group, whose abort closes nothing, so its connections
    must be shut: a gloo world's, and in a GPU job too (Megatron's gloo groups beside its NCCL/HCCL ones, the
    distributed optimizer's among them), where a rank may wait in one."""
    from torch.distributed import distributed_c10d as c10d

    return backend == "gloo" or any("gloo" in str(group_backend)
                                    for group_backend, _ in list(getattr(c10d._world, "pg_map", {}).values()))


def shut_connections(keep_peer_ports: set[int]) -> int:
    """Shut down every TCP connection of this process except those to ``keep_peer_ports`` (the control
    store); returns how many. For gloo, the only way to make a peer blocked on this rank fail at once:
    ``abort()`` and ``shutdown()`` of a gloo group close nothing, and freeing the group does not either
    when a child forked after the world was built (Megatron's data-loader workers) holds copies of its
    sockets. ``shutdown(2)`` acts on the connection itself, whoever holds a descriptor of it."""
    import socket

    from .sockets import tcp_connections

    closed = 0
    for sock in tcp_connections():
        try:
            if sock.getpeername()[1] not in keep_peer_ports:
                sock.shutdown(socket.SHUT_RDWR)
                closed += 1
        except OSError:  # closed meanwhile
            pass
    return closed


def clear_parallel_state() -> None:
    """Forget the groups of a world that is being torn down (before building the next)."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def plan_process_groups(groups: PlanGroups):
    """megatron-core's ProcessGroupCollection for a stage of this plan: real TP group, and a group of
    one for pipeline/context/data parallelism (the executor and per-unit sync do those)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    one = groups.self_group
    return ProcessGroupCollection(tp=groups.tp_group, pp=one, mp=groups.tp_group, cp=one, tp_cp=groups.tp_group,
                                  embd=None, pos_embd=None, dp=one, dp_cp=one)
