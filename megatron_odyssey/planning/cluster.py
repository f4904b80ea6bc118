"""The cluster a job was launched on: Megatron's TP x PP x DP grid and which nodes have failed.

A *node* is one tensor-parallel group (the TP ranks of one stage replica): losing any of its ranks
loses the node. Node ids follow Megatron's default rank order (TP fastest, then DP, then PP), so
the node of pipeline stage ``s`` in data-parallel replica ``d`` is ``s * dp + d`` and global rank
``= node * tp + tp_rank``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from .errors import PlanningError

# the ``odyssey plan`` flag that sets each field: messages name what the user typed
FLAGS = {"tp": "--tp", "pp": "--pp", "dp": "--dp", "num_layers": "--layers", "global_batch": "--global-batch",
         "micro_batch": "--micro-batch"}


def node_ranks(nodes: Iterable[int], tp: int) -> list[int]:
    """The launch-time global ranks of ``nodes``, in order: each node is ``tp`` consecutive ranks."""
    return [node * tp + t for node in nodes for t in range(tp)]


@dataclass(frozen=True)
class ClusterSpec:
    tp: int
    pp: int
    dp: int
    num_layers: int
    global_batch: int
    micro_batch: int
    failed: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        for name, flag in FLAGS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanningError(f"{flag} must be a positive integer, got {value!r}")
        if self.pp > self.num_layers:
            raise PlanningError(f"--pp {self.pp} is greater than --layers {self.num_layers}: "
                                "every pipeline stage needs at least one transformer layer")
        if self.global_batch % (self.micro_batch * self.dp) != 0:
            raise PlanningError(
                f"--global-batch {self.global_batch} is not divisible by --micro-batch x --dp "
                f"= {self.micro_batch} x {self.dp} = {self.micro_batch * self.dp}"
            )
        object.__setattr__(self, "failed", frozenset(self.failed))
        bad = sorted(n for n in self.failed if not 0 <= n < self.num_nodes)
        if bad:
            raise PlanningError(
                f"--failed names node(s) {bad} not in the cluster: node ids are 0..{self.num_nodes - 1} "
                f"(node = stage x DP + replica, with --pp {self.pp} --dp {self.dp})"
            )
        if len(self.failed) == self.num_nodes:
            raise PlanningError(f"--failed names all {self.num_nodes} nodes: nothing is left to plan on")

    @property
    def num_nodes(self) -> int:
        return self.pp * self.dp

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.tp

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches in one global batch (over all pipelines)."""
        return self.global_batch // self.micro_batch


def parse_node_list(text: str | None, flag: str = "--failed") -> frozenset[int]:
    """Parse ``"3,5"`` (the ``--failed`` flag) into node ids; junk and repeated ids are errors,
    since a typo that silently names fewer nodes would plan for the wrong failure."""
    if not text:
        return frozenset()
    nodes: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            nodes.append(int(part))
        except ValueError:
            raise PlanningError(f"{flag} expects comma-separated node ids (e.g. 3,5), got {part!r}") from None
    repeated = sorted({n for n in nodes if nodes.count(n) > 1})
    if repeated:
        raise PlanningError(f"{flag} {text}: node(s) {repeated} listed more than once")
    return frozenset(nodes)
