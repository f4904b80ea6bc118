"""Point-to-point messages between ranks, with the semantics of the strictest backend.

Every send and receive of the runtime (pipeline activations and gradients, state transfer) goes
through :class:`P2P`, so the rules are in one place:

- **No tags.** NCCL and HCCL ignore them: between two ranks the n-th receive gets the n-th send.
  Correctness must come from the order, so gloo runs are made to obey the same rule (every message
  is sent with tag 0) and CPU tests exercise exactly what a GPU job does.
- **Device tensors, staged where the backend cannot take them.** NCCL/HCCL send device tensors;
  gloo sends host tensors only (on CUDA tensors its send/recv fail with ``writev ... Bad
  address``). When a device job runs over gloo (several ranks sharing one GPU, for tests) each
  message is copied through host memory here, and the per-layer gradient all-reduce stages its
  buffer the same way (``grad_sync.all_reduce_flat``): gloo can reduce CUDA tensors, but a rank
  torn down during such a reduction (a peer fenced after a hang) ended in std::terminate on an H100.

:class:`Mailbox` takes a sender's messages in the sender's order
(:func:`~megatron_odyssey.planning.schedule.receive_orders`) and holds the ones that arrive before
they are needed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch
import torch.distributed as dist


@dataclass
class _Pending:
    work: dist.Work
    keep: torch.Tensor  # the buffer must outlive the send

    def wait(self) -> bool:
        self.work.wait()
        return True


@dataclass(frozen=True)
class P2P:
    """Sends and receives for one rank. ``staged``: copy device tensors through host memory."""

    staged: bool = False

    @classmethod
    def for_backend(cls, backend: str, device: torch.device | str) -> "P2P":
        return cls(staged=backend == "gloo" and torch.device(device).type != "cpu")

    def isend(self, tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> _Pending:
        tensor = tensor.detach().contiguous()
        if self.staged and tensor.device.type != "cpu":
            tensor = tensor.cpu()
        return _Pending(dist.isend(tensor, dst=dst, group=group), tensor)

    def recv(self, tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """Receive into ``tensor`` (in place) and return it."""
        if self.staged and tensor.device.type != "cpu":
            host = torch.empty(tensor.shape, dtype=tensor.dtype)
            dist.recv(host, src=src, group=group)
            tensor.copy_(host)
        else:
            dist.recv(tensor, src=src, group=group)
        return tensor


@dataclass
class Mailbox:
    """Receives from each sender strictly in that sender's order (``orders``: src -> message keys),
    keeping messages that arrive before the one asked for."""

    p2p: P2P
    orders: dict[int, list[Hashable]]  # src (any id) -> message keys in the order src sends them
    rank_of: Callable[[int], int]  # src id -> world rank
    make_buffer: Callable[[Hashable], torch.Tensor]
    _next: dict[int, int] = field(default_factory=dict)
    _held: dict[Hashable, torch.Tensor] = field(default_factory=dict)

    def receive(self, src: int, key: Hashable) -> torch.Tensor:
        while key not in self._held:
            order, n = self.orders.get(src, []), self._next.get(src, 0)
            if n >= len(order):
                raise RuntimeError(f"message {key} from {src} is not in its send order {order}")
            self._held[order[n]] = self.p2p.recv(self.make_buffer(order[n]), self.rank_of(src))
            self._next[src] = n + 1
        return self._held.pop(key)

    def reset(self) -> None:
        """Start a new step (every message of the last one was consumed)."""
        if self._held:
            raise RuntimeError(f"messages received but never used: {sorted(map(str, self._held))}")
        self._next.clear()
