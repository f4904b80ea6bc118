"""Device tensors over gloo, through host copies: several ranks of one job sharing one GPU (tests).

A machine with one GPU cannot run a multi-rank Megatron-LM job as users run it: NCCL refuses two ranks on one
device, and gloo, the backend that accepts them, sends and receives host tensors only (on CUDA tensors its
send/recv fail with ``writev ... Bad address``), has no all-gather or reduce-scatter into device tensors, and a
CUDA all-reduce torn down mid-operation by a peer's failure ended an H100 rank in ``std::terminate``. With this
module enabled every torch.distributed operation that carries a device tensor runs on a host copy instead: its
inputs copied to the host (once every stream of the rank's device is through), its outputs copied back to the
device when it completes (at once for a blocking call, at ``wait()`` for an asynchronous one, at the end of a
``_coalescing_manager`` block or at its ``wait()`` for the operations it coalesced). Megatron-LM's own schedule,
DDP buckets, distributed optimizer and timers, and Odyssey's recovery, then run unchanged on the device, with
every message on the wire as in the CPU tests.

A rank blocked in one of these copies waits on its own device, not on a peer: the copies say so to the agent
(``liveness.on_own_device``), so a rank whose device hangs is the one fenced, not the peers waiting for its message.

It is test machinery: slower than NCCL (every message crosses PCIe twice) and never what a user runs.
``odyssey-launch`` jobs turn it on with ``ODYSSEY_SHARED_DEVICE=1`` (``megatron_adaptor``: every rank then binds
device 0 and Megatron-LM runs with ``--distributed-backend gloo``). ``stage_host_tensors=True`` stages host
tensors too (copies of copies): how a CPU machine checks that every operation is staged and copied back.

Names are replaced where torch defines them and wherever a module already holds the original (``from
torch.distributed import _coalescing_manager``; megatron-core's ``dist_all_gather_func``), so torch's own checks
(``P2POp``'s ``op in (isend, irecv)``, the coalescing manager's ``op0 is all_reduce``) see one object.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .liveness import on_own_device

#: each operation's tensor arguments: "in" (read), "out" (written), "inout" (both); lists of tensors alike
ROLES: dict[str, dict[str, str]] = {
    "send": {"tensor": "in"}, "isend": {"tensor": "in"},
    "recv": {"tensor": "out"}, "irecv": {"tensor": "out"},
    "broadcast": {"tensor": "inout"}, "all_reduce": {"tensor": "inout"}, "reduce": {"tensor": "inout"},
    "all_gather": {"tensor_list": "out", "tensor": "in"},
    "all_gather_into_tensor": {"output_tensor": "out", "input_tensor": "in"},
    "_all_gather_base": {"output_tensor": "out", "input_tensor": "in"},
    "all_gather_single": {"output_tensor": "out", "input_tensor": "in"},
    "reduce_scatter": {"output": "out", "input_list": "in"},
    "reduce_scatter_tensor": {"output": "out", "input": "in"},
    "_reduce_scatter_base": {"output": "out", "input": "in"},
    "reduce_scatter_single": {"output": "out", "input": "in"},
    "all_to_all_single": {"output": "out", "input": "in"},
}
#: operations that always return a work handle (the others only with async_op=True)
ALWAYS_ASYNC = ("isend", "irecv")

_ORIGINALS: dict[str, Callable[..., Any]] = {}
_WRAPPERS: dict[str, Callable[..., Any]] = {}
_REBOUND: list[tuple[Any, str, Any]] = []  # (module, name, original) for disable()
_LOCAL = threading.local()  # .inside: a staged call in progress on this thread; .frames: coalescing blocks
_SETTINGS = {"host_too": False}


def host_staging_enabled() -> bool:
    return bool(_ORIGINALS)


class StagedWork:
    """The work handle of a staged asynchronous operation: waits for it, then copies its outputs back."""

    def __init__(self, work: Any, copy_back: Callable[[], None], keep: list[torch.Tensor]):
        self.work, self._copy_back, self._keep, self._done = work, copy_back, keep, False

    def wait(self, *args: Any) -> bool:
        if self.work is not None:  # (None: a coalescing block's copy-back, after the block's own work)
            self.work.wait(*args)
        if not self._done:
            self._done = True
            self._copy_back()
            self._keep = []
        return True

    def is_completed(self) -> bool:
        return self._done or (self.work is not None and bool(self.work.is_completed()))

    def __bool__(self) -> bool:  # (``_CoalescingManager.append`` keeps only truthy works)
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def _needs_staging(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.device.type != "cpu" or _SETTINGS["host_too"])


def _host_copy(t: torch.Tensor, role: str) -> torch.Tensor:
    """A host copy of what the operation reads, taken once everything this rank queued on the device is done: a
    copy waits for the caller's stream only, while what it reads may still be written on another (core_r0.16.0's
    gradient hooks add into a bucket on DDP's set-up stream, and its reduction waits for the default stream), and
    a race there would make a shared-device run differ from itself, not only from NCCL's."""
    if role == "out":
        return torch.empty(t.shape, dtype=t.dtype)
    with on_own_device():
        if t.device.type == "cuda":
            torch.cuda.synchronize(t.device)
        return t.detach().to("cpu", copy=True)


def _stage(value: Any, role: str, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """``value`` (a tensor or a list of them) with every tensor that needs it replaced by a host copy; the
    (device, host) pairs to copy back after the operation go to ``copies`` for outputs."""
    if isinstance(value, (list, tuple)):
        staged = [_stage(v, role, copies) for v in value]
        return staged if isinstance(value, list) else type(value)(staged)
    if not _needs_staging(value):
        return value
    host = _host_copy(value, role)
    if role in ("out", "inout"):
        copies.append((value, host))
    return host


def _copier(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
    def copy_back() -> None:
        with torch.no_grad(), on_own_device():
            for device_tensor, host in copies:
                device_tensor.copy_(host)

    return copy_back


def _group_of(bound: inspect.BoundArguments) -> Any:
    group = bound.arguments.get("group")
    return group if group is not None else c10d._get_default_group()


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    roles = ROLES[name]
    signature = inspect.signature(original)

    @functools.wraps(original)
    def staged(*args: Any, **kwargs: Any) -> Any:
        if getattr(_LOCAL, "inside", False):  # (torch's all_gather_into_tensor calls all_gather_single)
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        keep: list[torch.Tensor] = []
        for arg, role in roles.items():
            if arg in bound.arguments:
                before = bound.arguments[arg]
                bound.arguments[arg] = _stage(before, role, copies)
                if bound.arguments[arg] is not before:
                    keep.append(bound.arguments[arg])
        if not keep:
            return original(*args, **kwargs)
        _LOCAL.inside = True
        try:
            result = original(*bound.args, **bound.kwargs)
        finally:
            _LOCAL.inside = False
        copy_back = _copier(copies)
        frame = _coalescing_frame(bound) if name not in ALWAYS_ASYNC else None
        if frame is not None:  # recorded by the coalescing manager, run at its end: copied back then
            frame.append(copy_back)
            frame.keep.extend(keep)
            return result
        if name in ALWAYS_ASYNC or bound.arguments.get("async_op", False):
            return StagedWork(result, copy_back, keep) if result is not None else None
        copy_back()
        return result

    staged.__odyssey_staged__ = original  # type: ignore[attr-defined]
    return staged


class _Frame(list):
    """The copy-backs of one ``_coalescing_manager`` block (and the host copies they read)."""

    def __init__(self) -> None:
        super().__init__()
        self.keep: list[torch.Tensor] = []


def _coalescing_frame(bound: inspect.BoundArguments) -> _Frame | None:
    frames = getattr(_LOCAL, "frames", {})
    return frames.get(_group_of(bound)) if frames else None


def _wrap_coalescing_manager(original: Callable[..., Any]) -> Callable[..., Any]:
    @contextlib.contextmanager
    @functools.wraps(original)
    def coalescing_manager(group: Any = None, device: Any = None, async_ops: bool = False):
        key = group if group is not None else c10d._get_default_group()
        frames = _LOCAL.__dict__.setdefault("frames", {})
        frame = frames[key] = _Frame()
        try:
            with original(group, device, async_ops) as cm:
                yield cm
        finally:
            frames.pop(key, None)
        copy_back = lambda: [f() for f in frame]  # noqa: E731
        if frame and async_ops:  # cm.wait() waits for the coalesced work first, then copies back
            cm.append(StagedWork(None, copy_back, frame.keep))
        elif frame:
            copy_back()

    coalescing_manager.__odyssey_staged__ = original  # type: ignore[attr-defined]
    return coalescing_manager


def enable_host_staging(stage_host_tensors: bool = False) -> None:
    """Stage every torch.distributed operation on device tensors through host copies (see the module docstring);
    ``stage_host_tensors``: host tensors too. Idempotent."""
    _SETTINGS["host_too"] = stage_host_tensors
    if _ORIGINALS:
        return
    for name in ROLES:
        original = getattr(c10d, name, None)
        if original is not None:
            _ORIGINALS[name] = original
            _WRAPPERS[name] = _wrap(name, original)
    _ORIGINALS["_coalescing_manager"] = c10d._coalescing_manager
    _WRAPPERS["_coalescing_manager"] = _wrap_coalescing_manager(c10d._coalescing_manager)
    by_id = {id(original): name for name, original in _ORIGINALS.items()}
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict) or module is sys.modules[__name__]:
            continue
        for attr, value in list(namespace.items()):
            name = by_id.get(id(value))
            if name is not None and value is _ORIGINALS[name]:
                setattr(module, attr, _WRAPPERS[name])
                _REBOUND.append((module, attr, value))
    if getattr(dist, "_coalescing_manager", None) is not _WRAPPERS["_coalescing_manager"]:
        setattr(dist, "_coalescing_manager", _WRAPPERS["_coalescing_manager"])
        _REBOUND.append((dist, "_coalescing_manager", _ORIGINALS["_coalescing_manager"]))


def disable_host_staging() -> None:
    """Put every original back where :func:`enable_host_staging` replaced it."""
    while _REBOUND:
        module, attr, original = _REBOUND.pop()
        setattr(module, attr, original)
    _ORIGINALS.clear()
    _WRAPPERS.clear()
    _SETTINGS["host_too"] = False
