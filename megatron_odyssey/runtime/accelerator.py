"""Accelerator abstraction and CPU mode for megatron-core.

One place knows which device kind the runtime drives (``cuda``, ``npu`` or ``cpu``) and
which ``torch.distributed`` backend goes with it (``nccl``, ``hccl``, ``gloo``). Everything
else in the runtime asks :func:`get_accelerator` instead of calling ``torch.cuda`` directly, so
the same code runs on NVIDIA GPUs, Ascend NPUs and plain CPUs.

``torch_npu`` is imported lazily, only when the NPU is asked for (explicitly, through
``ODYSSEY_DEVICE=npu``, or by auto-detection when no CUDA device exists and the package is
installed), because it is an optional extra that CI machines do not have.

CPU mode (:func:`enable_cpu_mode`) makes megatron-core's hard-coded CUDA calls run on the CPU,
the job ``torch_npu.contrib.transfer_to_npu`` does for Ascend. Every patch is one entry of
:data:`CPU_MODE_PATCHES` (target ``"module.attr"``, replacement, why); they are applied once
(idempotent) and :func:`disable_cpu_mode` restores the originals. Patches are scoped to
megatron-core modules: the process's own ``torch.cuda`` is never modified.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

DEVICE_TYPES: Tuple[str, ...] = ("cuda", "npu", "cpu")
#: torch.distributed backend used for each device type.
BACKEND_FOR_DEVICE: Dict[str, str] = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}
#: Environment variable that forces the device type (``cuda``, ``npu`` or ``cpu``).
DEVICE_ENV_VAR = "ODYSSEY_DEVICE"


# --------------------------------------------------------------------------------------------
# torch_npu (lazy)
# --------------------------------------------------------------------------------------------


def torch_npu_installed() -> bool:
    """True when ``torch_npu`` could be imported; does not import it."""
    return importlib.util.find_spec("torch_npu") is not None


@functools.lru_cache(maxsize=None)
def import_torch_npu() -> types.ModuleType:
    """Import ``torch_npu`` (registers the ``npu`` device and ``hccl`` backend with torch).

    Only called when the NPU is asked for, so machines without Ascend never pay for it.
    """
    try:
        return importlib.import_module("torch_npu")
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ImportError(
            "device type 'npu' needs the optional package torch_npu (Ascend); it is not "
            "installed. Install the torch_npu build matching your torch and CANN versions."
        ) from exc


# --------------------------------------------------------------------------------------------
# Accelerator
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Accelerator:
    """The device kind the runtime drives and the matching ``torch.distributed`` backend."""

    device_type: str
    backend: str

    def __post_init__(self) -> None:
        if self.device_type not in DEVICE_TYPES:
            raise ValueError(f"unknown device type {self.device_type!r}; expected {DEVICE_TYPES}")

    @property
    def module(self) -> Optional[types.ModuleType]:
        """``torch.cuda`` / ``torch.npu`` for accelerators, None for the CPU."""
        if self.device_type == "cuda":
            return torch.cuda
        if self.device_type == "npu":
            import_torch_npu()
            return getattr(torch, "npu")
        return None

    @property
    def is_cpu(self) -> bool:
        """True when the runtime computes on the host CPU."""
        return self.device_type == "cpu"

    def is_available(self) -> bool:
        """Whether at least one device of this type is usable in this process."""
        if self.is_cpu:
            return True
        return bool(self.module.is_available())  # type: ignore[union-attr]

    def device_count(self) -> int:
        """Number of visible devices (1 for the CPU)."""
        if self.is_cpu:
            return 1
        return int(self.module.device_count())  # type: ignore[union-attr]

    def device(self, local_rank: Optional[int] = None) -> torch.device:
        """The ``torch.device`` for ``local_rank`` (the current device when None)."""
        if self.is_cpu:
            return torch.device("cpu")
        if local_rank is None:
            local_rank = int(self.module.current_device())  # type: ignore[union-attr]
        return torch.device(self.device_type, local_rank)

    def set_device(self, local_rank: int) -> None:
        """Bind this process to device ``local_rank`` (no-op on the CPU)."""
        if not self.is_cpu:
            self.module.set_device(local_rank)  # type: ignore[union-attr]

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on the CPU, where work is synchronous)."""
        if not self.is_cpu:
            self.module.synchronize()  # type: ignore[union-attr]

    def manual_seed(self, seed: int) -> None:
        """Seed the host generator and, for accelerators, every device generator."""
        torch.manual_seed(seed)
        if not self.is_cpu:
            self.module.manual_seed_all(seed)  # type: ignore[union-attr]

    def empty_cache(self) -> None:
        """Release cached device memory (no-op on the CPU)."""
        if not self.is_cpu:
            self.module.empty_cache()  # type: ignore[union-attr]


def detect_device_type() -> str:
    """Pick the device type: ``$ODYSSEY_DEVICE``, else CUDA, else an installed torch_npu, else CPU.

    The torch_npu check uses ``find_spec`` so auto-detection on a CUDA or CPU machine never
    imports it.
    """
    forced = os.environ.get(DEVICE_ENV_VAR, "").strip().lower()
    if forced:
        if forced not in DEVICE_TYPES:
            raise ValueError(f"{DEVICE_ENV_VAR}={forced!r}; expected one of {DEVICE_TYPES}")
        return forced
    if torch.cuda.is_available():
        return "cuda"
    if torch_npu_installed():
        import_torch_npu()
        if getattr(torch, "npu", None) is not None and torch.npu.is_available():  # type: ignore[attr-defined]
            return "npu"
    return "cpu"


_ACCELERATOR: Optional[Accelerator] = None


def get_accelerator(device_type: Optional[str] = None) -> Accelerator:
    """The process-wide accelerator; ``device_type`` overrides (and replaces) it.

    Asking for ``"npu"`` imports torch_npu; nothing else does.
    """
    global _ACCELERATOR
    if device_type is not None:
        device_type = device_type.lower()
        if device_type not in DEVICE_TYPES:
            raise ValueError(f"unknown device type {device_type!r}; expected {DEVICE_TYPES}")
        if device_type == "npu":
            import_torch_npu()
        _ACCELERATOR = Accelerator(device_type, BACKEND_FOR_DEVICE[device_type])
    elif _ACCELERATOR is None:
        detected = detect_device_type()
        _ACCELERATOR = Accelerator(detected, BACKEND_FOR_DEVICE[detected])
    return _ACCELERATOR


def reset_accelerator() -> None:
    """Forget the cached accelerator (tests, or after changing ``$ODYSSEY_DEVICE``)."""
    global _ACCELERATOR
    _ACCELERATOR = None


def bind_rank_device(local_rank: int, shared: bool = False) -> torch.device:
    """Bind this process to its device and return it: ``local_rank``'s device, or device 0 for every
    rank when ``shared`` (several ranks on one GPU/NPU, for tests: NCCL/HCCL refuse two ranks on one
    device, so such jobs communicate over gloo, see :mod:`.transport`)."""
    acc = get_accelerator()
    if acc.is_cpu:
        return acc.device()
    count = acc.device_count()
    if shared:
        index = 0
    elif local_rank < count:
        index = local_rank
    else:
        raise RuntimeError(
            f"local rank {local_rank} has no {acc.device_type} device of its own ({count} visible); "
            f"run at most {count} ranks per machine, or pass --shared-device to let ranks share one "
            f"device (testing: communication then goes over gloo)")
    acc.set_device(index)
    return acc.device(index)


def rank_backend(shared: bool = False, device_type: Optional[str] = None) -> str:
    """The process-group backend of a rank: the device's (nccl/hccl/gloo; ``device_type``, default the current
    accelerator's), gloo when ranks share a device (``runtime.host_staging``: its host copies need gloo, and a
    recovering rank must shut its gloo connections for its peers to fail at once)."""
    return "gloo" if shared else dist_backend(device_type)


def dist_backend(device_type: Optional[str] = None) -> str:
    """The ``torch.distributed`` backend for ``device_type`` (default: the current accelerator)."""
    if device_type is None:
        return get_accelerator().backend
    return BACKEND_FOR_DEVICE[device_type.lower()]


def seed_all(seed: int, *, tp_rank: Optional[int] = None, ep_rank: int = 0, etp_rank: int = 0) -> None:
    """Seed Python, NumPy, torch and megatron's model-parallel RNG tracker, like Megatron-LM's
    ``_set_random_seed`` but on every device type.

    Megatron-LM skips ``model_parallel_cuda_manual_seed`` when no GPU is visible, yet every
    attention forward enters ``get_cuda_rng_tracker().fork()`` (even at dropout 0), so the
    tracker must be seeded on the CPU too (in CPU mode it is the CPU tracker).
    ``tp_rank`` defaults to ``parallel_state``'s; pass it when groups were built by hand.
    """
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % (2**32))
    get_accelerator().manual_seed(seed)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    if tp_rank is None:
        tp_rank = (
            parallel_state.get_tensor_model_parallel_rank()
            if parallel_state.model_parallel_is_initialized()
            else 0
        )
    mrandom.model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=ep_rank, etp_rank=etp_rank)


# --------------------------------------------------------------------------------------------
# CPU mode: views of torch that megatron-core modules see instead of the real one
# --------------------------------------------------------------------------------------------

_CPU = torch.device("cpu")


def _is_cuda_device(device: Any) -> bool:
    """True for anything megatron passes to mean "the GPU": "cuda", "cuda:0", cuda devices, ints."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class _CpuStream:
    """A CUDA stream on the CPU: work is synchronous, so every wait and record is already satisfied."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> Any:
        return event

    def synchronize(self) -> None:
        return None


class CpuCudaView:
    """What ``torch.cuda`` looks like to a megatron-core module in CPU mode.

    The "current device" is the CPU, synchronisation is a no-op (CPU work is synchronous) and
    the "CUDA" generator is torch's CPU generator. Anything else falls through to the real
    ``torch.cuda`` (e.g. ``is_available()`` stays truthful).
    """

    @staticmethod
    def current_device() -> torch.device:
        return _CPU

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        torch.set_rng_state(new_state)

    @staticmethod
    def empty_cache() -> None:
        return None

    # megatron-core 0.19+ waits on the current stream for CUDA-graph events before a bucket's reduce
    Stream = _CpuStream

    @staticmethod
    def current_stream(device: Any = None) -> _CpuStream:
        return _CpuStream()

    @staticmethod
    def default_stream(device: Any = None) -> _CpuStream:
        return _CpuStream()

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


def _device_remapping(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a torch factory so ``device="cuda"`` (or an index) allocates on the CPU."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
            kwargs.pop("pin_memory", None)  # pinning needs a CUDA runtime
        return fn(*args, **kwargs)

    return wrapper


_FACTORIES: Tuple[str, ...] = (
    "empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint",
)


class CpuTorchView(types.ModuleType):
    """What ``torch`` looks like to a megatron-core module in CPU mode.

    Everything is the real torch except ``torch.cuda`` (a :class:`CpuCudaView`) and the tensor
    factories, whose ``device="cuda"`` argument is mapped to the CPU. Installed as the module
    global ``torch`` of the few megatron modules listed in :data:`CPU_MODE_PATCHES`, so torch
    itself and every other library keep the real behaviour.
    """

    def __init__(self) -> None:
        super().__init__("torch", "megatron-odyssey CPU-mode view of torch")
        self.cuda = CpuCudaView()
        for name in _FACTORIES:
            setattr(self, name, _device_remapping(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


# --------------------------------------------------------------------------------------------
# CPU mode: RNG
# --------------------------------------------------------------------------------------------


def _cpu_get_rng_state(
    device: Any = "cuda", clone: bool = False, graph_safe: bool = False
) -> torch.Tensor:
    """CPU-mode ``_get_cuda_rng_state``: the state of torch's CPU generator."""
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """CPU-mode ``_set_cuda_rng_state``: set torch's CPU generator state, now.

    The original defers the set through ``torch.cuda._lazy_call``, which on a machine without
    CUDA queues the callback forever, i.e. silently does nothing.
    """
    torch.set_rng_state(new_state)


@functools.lru_cache(maxsize=None)
def cpu_rng_tracker_class() -> type:
    """Build (once) the CPU RNG tracker, a subclass of megatron's ``CudaRNGStatesTracker``.

    Subclassing keeps megatron's ``isinstance`` checks (``get_all_rng_states``) and bookkeeping
    (``reset``/``get_states``/``set_states``) intact; only ``add`` and ``fork`` change.
    Created lazily so importing this module does not import megatron-core.
    """
    from megatron.core.tensor_parallel import random as mrandom

    base = mrandom.CudaRNGStatesTracker
    default_name = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME

    class CpuRNGStatesTracker(base):  # type: ignore[valid-type, misc]
        """Named states of torch's CPU generator, forked like megatron forks CUDA states.

        ``fork(name)`` swaps the tracked state into the CPU generator, runs the block (dropout,
        initialisation), stores the advanced state back and restores the caller's state, so
        tensor-parallel-region randomness is reproducible and independent of the default
        stream, exactly as on GPUs.
        """

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"cpu rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name: str = default_name) -> Iterator[None]:
            # Megatron's fork also warns when the *CPU* state moves inside the fork; in CPU
            # mode the forked generator is the CPU one, so that check would always fire.
            if name not in self.states_:
                raise Exception(f"cpu rng state {name} is not added")
            orig_state = torch.get_rng_state()
            orig_name = getattr(self, "_current_state_name", "default-rng")  # megatron-core < 0.15 has none
            if orig_name != "default-rng":
                self.states_[orig_name] = orig_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                if self._current_state_name != name:
                    raise Exception(
                        f"current state name {self._current_state_name} is not the same as the "
                        f"desired state name {name}."
                    )
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig_state = self.states_[orig_name]
                torch.set_rng_state(orig_state)
                self._current_state_name = orig_name

    return CpuRNGStatesTracker


class _LazyCpuRngTracker:
    """Replacement marker resolved at apply time (the class needs megatron imported)."""


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """CPU-mode ``get_default_causal_mask``: the same upper-triangular mask, on the CPU."""
    return torch.triu(torch.ones(sq, sq, device=_CPU), diagonal=1).bool()


# --------------------------------------------------------------------------------------------
# CPU mode: the patch table
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Patch:
    """One CPU-mode patch: set ``target`` (``"package.module.attr"``) to ``replacement``."""

    target: str
    replacement: Any
    why: str


class _SendCopyDistributed(types.ModuleType):
    """``torch.distributed`` whose point-to-point sends carry a private copy of the tensor. Megatron's
    schedules swap a sent output's ``.data`` for a 1-element tensor right after posting the send
    (``deallocate_output_tensor``): on CUDA the send already holds the old storage in stream order; gloo
    reads the tensor later, from the new storage (the interleaved schedule's asynchronous sends then
    delivered garbage and iterations differed run to run)."""

    def __init__(self) -> None:
        super().__init__("torch.distributed", "megatron-odyssey CPU-mode view of torch.distributed")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.distributed, name)

    @staticmethod
    def isend(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return torch.distributed.isend(tensor.clone(), *args, **kwargs)

    @staticmethod
    def P2POp(op: Callable[..., Any], tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        if op in (torch.distributed.isend, _SendCopyDistributed.isend):
            return torch.distributed.P2POp(torch.distributed.isend, tensor.clone(), *args, **kwargs)
        return torch.distributed.P2POp(op, tensor, *args, **kwargs)


class P2PCpuTorchView(CpuTorchView):
    def __init__(self) -> None:
        super().__init__()
        self.distributed = _SendCopyDistributed()


_TORCH_VIEW = CpuTorchView()
_P2P_TORCH_VIEW = P2PCpuTorchView()
_MCORE = "megatron.core"

#: Every CPU-mode patch. Targets are module globals (or class attributes) inside megatron-core;
#: ``torch`` entries replace the module's view of torch with :class:`CpuTorchView`, which maps
#: ``torch.cuda.current_device()``/``synchronize()``/``device="cuda"`` to the CPU for that module
#: only. The list is the minimum the Llama stage model (fp32, local spec, CPU init, TP without
#: sequence parallelism), megatron's schedules, p2p and timers need; each entry was checked by
#: removing it and watching a test fail, except ``_set_cuda_rng_state`` (kept because the
#: original silently does nothing without CUDA). Features that would need more entries:
#: ``gather_output``/sequence parallelism (``tensor_parallel.mappings.torch``),
#: gradient-accumulation fusion or GPU initialisation (``tensor_parallel.layers.torch``).
CPU_MODE_PATCHES: Tuple[Patch, ...] = (
    # --- RNG (tensor_parallel/random.py) ---
    Patch(f"{_MCORE}.tensor_parallel.random.CudaRNGStatesTracker", _LazyCpuRngTracker,
          "initialize_rng_tracker() instantiates this name; the CPU tracker forks torch's CPU generator"),
    Patch(f"{_MCORE}.tensor_parallel.random._get_cuda_rng_state", _cpu_get_rng_state,
          "reads torch.cuda's generator (raises without CUDA); used by checkpoint recompute"),
    Patch(f"{_MCORE}.tensor_parallel.random._set_cuda_rng_state", _cpu_set_rng_state,
          "defers through torch.cuda._lazy_call, which never runs without CUDA: a silent no-op"),
    # --- forward path ---
    Patch(f"{_MCORE}.models.common.embeddings.rotary_pos_embedding.torch", _TORCH_VIEW,
          "RotaryEmbedding.get_emb moves inv_freq to torch.cuda.current_device() on first forward"),
    Patch(f"{_MCORE}.fusions.fused_softmax.get_default_causal_mask", _cpu_default_causal_mask,
          "the torch softmax fallback builds the causal mask with device='cuda' when no mask is passed"),
    Patch(f"{_MCORE}.utils.torch", _TORCH_VIEW,
          "GlobalMemoryBuffer.get_tensor (DotProductAttention's matmul buffer) allocates on current_device()"),
    # --- schedules, p2p, timers ---
    Patch(f"{_MCORE}.pipeline_parallel.schedules.torch", _TORCH_VIEW,
          "forward_backward_* count tokens in torch.zeros(..., device='cuda')"),
    Patch(f"{_MCORE}.pipeline_parallel.p2p_communication.torch", _P2P_TORCH_VIEW,
          "p2p buffers on current_device(); a sent tensor's storage is swapped while gloo reads it: send a copy"),
    Patch(f"{_MCORE}.timers.torch", _TORCH_VIEW,
          "Timer.start/stop call torch.cuda.synchronize(); all-rank timing gathers on current_device()"),
)


@dataclass
class _Applied:
    owner: Any
    attr: str
    original: Any
    had_attr: bool


_LOCK = threading.RLock()
_APPLIED: List[_Applied] = []
_SAVED_TRACKER: Optional[Tuple[Any, bool]] = None


def _resolve(target: str) -> Tuple[Any, str]:
    """Split ``"pkg.mod.Class.attr"`` into (owner object, attribute name), importing the module."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        modname = ".".join(parts[:cut])
        try:
            owner: Any = importlib.import_module(modname)
        except ModuleNotFoundError:
            continue
        for name in parts[cut:-1]:
            owner = getattr(owner, name)
        return owner, parts[-1]
    raise ImportError(f"cannot resolve patch target {target!r}")


def install_patch(owner: Any, attr: str, build: Callable[[Any], Any], applied: List[_Applied]) -> None:
    """Set ``owner.attr`` to ``build(original)`` and record how to undo it in ``applied``. Shared by
    megatron-core's CPU mode here and Megatron-LM's (``megatron_lm.cpu_mode``)."""
    had = attr in vars(owner) if isinstance(owner, (type, types.ModuleType)) else hasattr(owner, attr)
    original = getattr(owner, attr, None)
    setattr(owner, attr, build(original))
    applied.append(_Applied(owner, attr, original, had))


def undo_patches(applied: List[_Applied]) -> None:
    """Restore what :func:`install_patch` replaced, newest first."""
    while applied:
        rec = applied.pop()
        if rec.had_attr:
            setattr(rec.owner, rec.attr, rec.original)
        else:  # e.g. Tensor.cuda is inherited from TensorBase: drop the override
            try:
                delattr(rec.owner, rec.attr)
            except AttributeError:
                pass


def cpu_mode_enabled() -> bool:
    """True while the CPU-mode patches are applied."""
    return bool(_APPLIED)


def enable_cpu_mode() -> None:
    """Apply every patch of :data:`CPU_MODE_PATCHES` (idempotent) and select the CPU accelerator.

    Also drops an RNG tracker megatron created earlier, so the next ``get_cuda_rng_tracker()``
    or ``model_parallel_cuda_manual_seed()`` builds the CPU one. Call it before seeding.
    """
    global _SAVED_TRACKER
    with _LOCK:
        if _APPLIED:
            return
        get_accelerator("cpu")
        try:
            for patch in CPU_MODE_PATCHES:
                value = cpu_rng_tracker_class() if patch.replacement is _LazyCpuRngTracker else patch.replacement
                install_patch(*_resolve(patch.target), lambda _original, value=value: value, _APPLIED)
            from megatron.core.tensor_parallel import random as mrandom

            _SAVED_TRACKER = (mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED)
            if not isinstance(mrandom._CUDA_RNG_STATE_TRACKER, cpu_rng_tracker_class()):
                mrandom._CUDA_RNG_STATE_TRACKER = None
                mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
        except BaseException:
            _restore_all()
            raise


def _restore_all() -> None:
    global _SAVED_TRACKER
    undo_patches(_APPLIED)
    if _SAVED_TRACKER is not None:
        from megatron.core.tensor_parallel import random as mrandom

        if isinstance(mrandom._CUDA_RNG_STATE_TRACKER, cpu_rng_tracker_class()):
            mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = _SAVED_TRACKER
        _SAVED_TRACKER = None


def disable_cpu_mode() -> None:
    """Restore every original patched by :func:`enable_cpu_mode` (no-op when not enabled)."""
    with _LOCK:
        if _APPLIED:
            _restore_all()
            reset_accelerator()


@contextlib.contextmanager
def cpu_mode() -> Iterator[None]:
    """Context manager: CPU mode inside, previous state after."""
    was_enabled = cpu_mode_enabled()
    enable_cpu_mode()
    try:
        yield
    finally:
        if not was_enabled:
            disable_cpu_mode()


def describe_cpu_mode_patches() -> List[Dict[str, str]]:
    """The patch table as plain dicts (for logs and docs)."""
    return [{"target": p.target, "why": p.why} for p in CPU_MODE_PATCHES]
