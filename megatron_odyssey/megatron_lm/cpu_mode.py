"""Run Megatron-LM's own training scripts (``pretrain_gpt.py`` & co.) on CPU, over gloo.

Megatron-LM's training side (``megatron.training``, which lives in the Megatron-LM source tree,
not in the megatron-core wheel) hard-codes CUDA: ``initialize_megatron`` asserts a GPU,
``_compile_dependencies`` builds CUDA fused kernels, the training loop allocates its bookkeeping
tensors with ``device="cuda"`` and moves batches and models with ``.cuda()``. This module makes
the *unmodified* training loop run on the host CPU, so real Megatron-LM training (every rank a
process, gloo as the backend, TP/PP/DP as on GPUs) can be used in tests, CI and demos on
machines without accelerators. It is the CPU counterpart of what
``torch_npu.contrib.transfer_to_npu`` does for Ascend NPUs.

Usage: add, before anything else in the training script::

    from megatron_odyssey.megatron_lm.cpu_mode import enable_megatron_lm_cpu_mode
    enable_megatron_lm_cpu_mode()

and launch with ``--distributed-backend gloo`` plus flags that keep off CUDA-only kernels
(``--transformer-impl local --use-cpu-initialization --no-gradient-accumulation-fusion
--no-masked-softmax-fusion --no-bias-*-fusion --no-rope-fusion --no-persist-layer-norm``).
With tensor or context parallelism, set ``CUDA_DEVICE_MAX_CONNECTIONS=1`` as on pre-Blackwell
GPUs (``validate_args`` checks it; it has no effect on CPU).

:func:`enable_megatron_lm_cpu_mode` first turns on megatron-core's CPU mode
(:func:`~megatron_odyssey.runtime.accelerator.enable_cpu_mode`), then applies
:data:`MEGATRON_LM_CPU_PATCHES`: module globals inside ``megatron.training`` (a view of
``torch`` whose ``torch.cuda`` is the CPU, or a CPU replacement of one function), the few
megatron-core modules only the training loop reaches (DDP buffers, optimizer, rerun state
machine), and one process-wide patch, ``torch.Tensor.cuda``. It is idempotent;
:func:`disable_megatron_lm_cpu_mode` restores every original (and turns megatron-core's CPU
mode off again if it was this module that turned it on).

``megatron.training`` is imported only when the mode is enabled, so this module imports fine
with just the megatron-core wheel installed.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import threading
import types
from typing import Any, Callable, List, Optional, Tuple

import torch

from megatron_odyssey.runtime.accelerator import (
    CpuCudaView,
    CpuTorchView,
    Patch,
    _Applied,
    _resolve,
    cpu_mode_enabled,
    disable_cpu_mode,
    enable_cpu_mode,
    install_patch,
    undo_patches,
)

__all__ = [
    "MEGATRON_LM_CPU_PATCHES",
    "TrainingCpuCudaView",
    "TrainingCpuTorchView",
    "describe_megatron_lm_cpu_patches",
    "disable_megatron_lm_cpu_mode",
    "enable_megatron_lm_cpu_mode",
    "load_dataset_helpers",
    "megatron_lm_cpu_mode_enabled",
]


# --------------------------------------------------------------------------------------------
# Views of torch for megatron.training modules
# --------------------------------------------------------------------------------------------


class TrainingCpuCudaView(CpuCudaView):
    """``torch.cuda`` as Megatron-LM's training modules see it in CPU mode.

    On top of :class:`CpuCudaView` (current device = CPU, no-op synchronize, CPU generator):
    the CPU counts as this rank's one device (``_initialize_distributed`` builds the
    model-parallel groups, and ``_set_random_seed`` seeds the model-parallel RNG tracker, only
    when ``device_count() > 0``), ``set_device`` is a no-op, and streams are torch's no-op CPU
    streams (``get_model`` wraps DDP construction in a side stream).
    """

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    Stream = torch.cpu.Stream

    @staticmethod
    def current_stream(device: Any = None) -> Any:
        return torch.cpu.current_stream()

    @staticmethod
    def stream(stream: Any) -> Any:
        return torch.cpu.stream(stream)


class TrainingCpuTorchView(CpuTorchView):
    """:class:`CpuTorchView` (``device="cuda"`` factories allocate on the CPU) whose ``cuda``
    is a :class:`TrainingCpuCudaView`."""

    def __init__(self) -> None:
        super().__init__()
        self.cuda = TrainingCpuCudaView()


class NamedCudaDeviceCpuTorchView(CpuTorchView):
    """:class:`CpuTorchView` whose ``torch.device("cuda", i)`` is the CPU: for a module that names its device
    instead of passing ``device="cuda"`` to a factory (0.18+ ``fault_injector.setup_fault_injection``)."""

    @staticmethod
    def device(kind: Any, index: Any = None) -> torch.device:
        if isinstance(kind, str) and kind.split(":")[0] == "cuda":
            return torch.device("cpu")
        return torch.device(kind) if index is None else torch.device(kind, index)


_TRAINING_TORCH_VIEW = TrainingCpuTorchView()
#: For megatron-core modules: the accelerator's plain view (device_count stays truthful).
_CORE_TORCH_VIEW = CpuTorchView()


# --------------------------------------------------------------------------------------------
# Replacements
# --------------------------------------------------------------------------------------------


def _tensor_cuda(
    self: torch.Tensor,
    device: Any = None,
    non_blocking: bool = False,
    memory_format: torch.memory_format = torch.preserve_format,
) -> torch.Tensor:
    """CPU-mode ``Tensor.cuda``: the tensor stays on the CPU (``nn.Module.cuda`` goes through
    this too). Without a CUDA device the original can only raise."""
    if memory_format is not torch.preserve_format:
        return self.contiguous(memory_format=memory_format)
    return self


class _WrapOriginal:
    """Replacement built at apply time from the original (which needs megatron.training)."""

    def __init__(self, build: Callable[[Any], Any]) -> None:
        self.build = build

    def __repr__(self) -> str:
        return f"_WrapOriginal({self.build.__name__})"


def _no_fp8_params_to_fix(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``checkpointing.fix_fp8_params_lose_precision_when_loading_dist_ckpt``: core_r0.12.0's torch_dist
    load calls it on every load, and it first asks ``is_te_min_version("2.0")``, which raises without Transformer
    Engine (every CPU). It only changes fp8 parameters (``--fp8-param-gather``, which needs Transformer Engine):
    without that flag there is nothing to fix."""

    @functools.wraps(original)
    def fix(state_dict: Any) -> Any:
        from megatron.training import get_args

        if not getattr(get_args(), "fp8_param_gather", False):
            return None
        return original(state_dict)

    return fix


def _no_fp8_params_to_quantize(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``fp8_utils._quantize_param_shard_impl``: megatron-core 0.12's distributed optimizer calls it after
    every step, also with no fp8 parameter at all, and without Transformer Engine (every CPU) it raises
    "Invalid Transformer Engine version for FP8 distributed optimizer" whatever it is given. Nothing to
    quantize is nothing to do."""

    @functools.wraps(original)
    def quantize(model_params: Any, *args: Any, **kwargs: Any) -> Any:
        if not model_params:
            return None
        return original(model_params, *args, **kwargs)

    return quantize


def _before_016() -> bool:
    from .versions import installed_version

    version = installed_version()
    return version is not None and version.major == 0 and version.minor < 16


def _no_step_in_bucket_state(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``DistributedOptimizer.get_parameter_state_dp_reshardable`` in megatron-core 0.15 (0.12-0.14 lack this
    format; later releases are left alone): the save of its default checkpoint format asserts that every
    per-parameter optimizer state is a slice of the gradient buffer, and torch's Adam (every CPU: no Apex or
    Transformer Engine) also keeps a 0-dim ``step`` there, so stock fails its first save. 0.16 keeps ``step`` out
    of the checkpoint (it is saved in the param groups); so does this. Loading takes the three wrappers below."""
    if not _before_016():
        return original

    @functools.wraps(original)
    def get_parameter_state_dp_reshardable(self: Any) -> Any:
        state = original(self)
        for gbuf_idx in range(len(self.gbuf_ranges)):
            for buckets in state[gbuf_idx].values():
                for bucket in buckets:
                    for tensors in bucket:
                        tensors.pop("step", None)
        return state

    return get_parameter_state_dp_reshardable


def _uses_torch_adam(original: Callable[..., Any]) -> bool:
    """The release's distributed optimizer runs torch's Adam (no Apex or Transformer Engine: every CPU), the case
    its own ``HAVE_APEX_OR_TE`` names."""
    return not getattr(importlib.import_module(original.__module__), "HAVE_APEX_OR_TE", True)


def _state_dict_before_any_step(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``DistributedOptimizer.state_dict``: with torch's Adam it reads the step count off the per-parameter
    state and asserts there is exactly one, but a load (``--load``, every release) asks for this template before
    any step, when torch's state is still empty: every rank fails with a bare AssertionError. With Apex or
    Transformer Engine the step lives in the param groups and a missing one is allowed; here one step of 0 stands
    in while the template is made (the load replaces it with the checkpoint's)."""
    if not _uses_torch_adam(original):
        return original

    @functools.wraps(original)
    def state_dict(self: Any) -> Any:
        if self.optimizer.state:
            return original(self)
        first = next((p for group in self.optimizer.param_groups for p in group["params"]), None)
        if first is None:
            return original(self)
        self.optimizer.state[first] = {"step": torch.tensor(0.0)}
        try:
            return original(self)
        finally:
            self.optimizer.state.pop(first, None)

    return state_dict


def _load_into_main_params(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``DistributedOptimizer._set_main_param_and_optimizer_states``, which a load calls to copy the
    checkpoint's tensors into each main parameter and every tensor of its optimizer state:
    - torch's Adam keeps its 0-dim ``step`` in that state. The step's truth is the param groups, which
      ``load_state_dict`` has put in already ("read from param_groups", as Megatron says), but the layout-free
      format's per-parameter state leaves it out (``KeyError: 'step'`` on every load), and the default format's
      carries the template's: the placeholder of the empty state before the load, so every step restarted at 0
      (the resume left stock's course at its second iteration). The state's own step is passed as the source.
    - the default format's loader (``load_parameter_state_from_dp_reshardable``) runs with autograd on, unlike the
      layout-free one, and an fp32 job's main parameters are views of its model parameters: "a view of a leaf
      Variable that requires grad is being used in an in-place operation". A load is no computation to record."""
    torch_adam = _uses_torch_adam(original)

    @functools.wraps(original)
    def set_main_param_and_optimizer_states(self: Any, model_param: Any, tensors: dict) -> Any:
        if torch_adam:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state.get(main_param, {}).get("step")
            tensors = {k: v for k, v in tensors.items() if k != "step"}
            if isinstance(step, torch.Tensor):
                tensors["step"] = step
        with torch.no_grad():
            return original(self, model_param, tensors)

    return set_main_param_and_optimizer_states


def _one_step_tensor_per_parameter(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``DistributedOptimizer.load_state_dict``: with torch's Adam it gives every parameter's state the same
    ``step`` tensor, which torch's Adam then advances in place once per parameter, so from the second step after a
    load its bias correction is wrong (a resume leaves stock's own course at the second iteration). Each state gets
    its own copy."""
    if not _uses_torch_adam(original):
        return original

    @functools.wraps(original)
    def load_state_dict(self: Any, state_dict: Any) -> Any:
        out = original(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
        return out

    return load_state_dict


def _cuda_type_names(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``Float16OptimizerWithFloat16Params.__init__``: it sorts parameters by ``param.type()``
    and accepts only ``torch.cuda.*`` names; while it runs, a CPU tensor's ``type()`` answers with
    the CUDA name of its dtype (what ``torch_npu``'s transfer_to_npu does for NPU tensors)."""

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        real = torch.Tensor.type

        def type_(tensor: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kw: Any) -> Any:
            if dtype is None and not kw and tensor.device.type == "cpu":
                return real(tensor).replace("torch.", "torch.cuda.", 1)
            return real(tensor, dtype, non_blocking, **kw)

        torch.Tensor.type = type_  # type: ignore[method-assign]
        try:
            original(self, *args, **kwargs)
        finally:
            torch.Tensor.type = real  # type: ignore[method-assign]

    return __init__


def _allow_no_cuda(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``initialize_megatron`` so it is always called with ``allow_no_cuda=True``."""

    @functools.wraps(original)
    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    initialize_megatron.__wrapped_for_cpu__ = True  # type: ignore[attr-defined]
    return initialize_megatron


def _skip_warmup_jit_function(*args: Any, **kwargs: Any) -> None:
    """CPU-mode ``_warmup_jit_function``: nothing to warm up (see the patch table; 0.19 passes ``tp_size``)."""
    return None


def _cpu_device_arch_version() -> int:
    """CPU-mode ``get_device_arch_version``: no CUDA architecture, i.e. 0 ("pre-Blackwell")."""
    return 0


def _cpu_clip_grad_by_total_norm_fp32(
    parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    """CPU-mode ``clip_grad_by_total_norm_fp32``: megatron-core's function minus its assertion
    that every gradient is a ``torch.cuda.FloatTensor`` (here they are fp32 CPU tensors)."""
    from megatron.core.optimizer import clip_grads as cg

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = []
    for param in parameters:
        if use_decoupled_grad:
            grad = getattr(param, "decoupled_grad", None)
            allowed: Tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
        else:
            grad, allowed = param.grad, (torch.float32,)
        if grad is not None:
            assert grad.dtype in allowed, f"gradient dtype {grad.dtype}, expected {allowed}"
            grads.append(cg.to_local_if_dtensor(grad).detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        overflow = torch.zeros(1, dtype=torch.int)
        cg.multi_tensor_applier(cg.multi_tensor_scale_impl, overflow, [grads, grads], clip_coeff)


# --- dataset C++ helpers ---------------------------------------------------------------------

_HELPERS = "megatron.core.datasets.helpers_cpp"


def _find_shipped_helpers() -> Optional[str]:
    """Path of a ``megatron/core/datasets/helpers_cpp`` extension built for this interpreter
    on ``sys.path`` (the megatron-core wheel ships one), or None."""
    for entry in sys.path:
        folder = os.path.join(entry or os.getcwd(), "megatron", "core", "datasets")
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            candidate = os.path.join(folder, "helpers_cpp" + suffix)
            if os.path.isfile(candidate):
                return candidate
    return None


def load_dataset_helpers() -> types.ModuleType:
    """Import ``megatron.core.datasets.helpers_cpp`` (the dataset index builders).

    When the imported megatron-core has no compiled copy (a Megatron-LM source checkout first
    on ``sys.path`` shadows the wheel's ``megatron.core``), load the one the megatron-core
    wheel ships under the same module name, instead of compiling it. Raises ImportError when
    neither exists.
    """
    try:
        return importlib.import_module(_HELPERS)
    except ImportError:
        path = _find_shipped_helpers()
        if path is None:
            raise
    spec = importlib.util.spec_from_file_location(_HELPERS, path)
    if spec is None or spec.loader is None:  # pragma: no cover - defensive
        raise ImportError(f"cannot load {_HELPERS} from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[_HELPERS] = module
    return module


def _cpu_compile_dependencies() -> None:
    """CPU-mode ``_compile_dependencies``: dataset helpers only, never the CUDA fused kernels.

    Uses compiled helpers when any can be imported (see :func:`load_dataset_helpers`); else
    falls back to megatron's own ``compile_helpers()`` on rank 0, as the original does.
    """
    try:
        load_dataset_helpers()
        return
    except ImportError:
        pass
    if torch.distributed.get_rank() == 0:
        from megatron.core.datasets.utils import compile_helpers

        compile_helpers()
    torch.distributed.barrier()
    load_dataset_helpers()


# --------------------------------------------------------------------------------------------
# The patch table
# --------------------------------------------------------------------------------------------

_MT = "megatron.training"
_MC = "megatron.core"

#: Every Megatron-LM CPU-mode patch, applied after megatron-core's ``CPU_MODE_PATCHES``.
#: Each entry was checked by removing it and rerunning ``pretrain_gpt.py`` (TP=2 x PP=2 on 4
#: gloo ranks): all but ``_warmup_jit_function`` then fail; that one only saves 7-17 s of
#: torch.compile C++ builds at start-up. ``torch.Tensor.cuda`` is the only process-wide entry:
#: ``get_model`` (``model.cuda()``) and ``get_batch_on_this_tp_rank`` (``batch[k].cuda()``)
#: call it as a tensor method, which no module-level view can intercept.
MEGATRON_LM_CPU_PATCHES: Tuple[Patch, ...] = (
    # --- megatron.training ---
    Patch(f"{_MT}.training.initialize_megatron", _WrapOriginal(_allow_no_cuda),
          "pretrain() calls initialize_megatron() without allow_no_cuda=True, which asserts CUDA"),
    Patch(f"{_MT}.arguments.get_device_arch_version", _cpu_device_arch_version,
          "validate_args() asks torch.cuda.get_device_properties() for the arch when TP/CP > 1"),
    Patch(f"{_MT}.initialize._compile_dependencies", _cpu_compile_dependencies,
          "initialize_megatron() builds CUDA fused kernels (nvcc) and compiles helpers with make"),
    Patch(f"{_MT}.initialize._warmup_jit_function", _skip_warmup_jit_function,
          "set_jit_fusion_options() torch.compiles unused CUDA fusions on device='cuda': 7-17 s"),
    Patch(f"{_MT}.initialize.torch", _TRAINING_TORCH_VIEW,
          "_initialize_distributed()/_set_random_seed() skip mpu groups and RNG seeds at 0 devices"),
    Patch(f"{_MT}.training.torch", _TRAINING_TORCH_VIEW,
          "get_model()/train() use current_device(), cuda streams and device='cuda' flag tensors"),
    Patch(f"{_MT}.utils.torch", _TRAINING_TORCH_VIEW,
          "get_batch_on_this_tp_rank() broadcasts batches into torch.cuda.current_device() buffers"),
    Patch(f"{_MT}.utils.common_utils.torch", _TRAINING_TORCH_VIEW,
          "0.18+ (utils is a package): get_batch_on_this_tp_rank() etc. use current_device() tensors"),
    Patch(f"{_MT}.models.dist_utils.torch", _TRAINING_TORCH_VIEW,
          "0.19+ wraps models in DDP here (training.get_model's successor): torch.cuda.Stream, current_device()"),
    Patch(f"{_MT}.checkpointing.torch", _TRAINING_TORCH_VIEW,
          "get_rng_state()/load_checkpoint() read and set torch.cuda RNG states; save/load use cuda tensors"),
    Patch(f"{_MT}.checkpointing.fix_fp8_params_lose_precision_when_loading_dist_ckpt",
          _WrapOriginal(_no_fp8_params_to_fix),
          "0.12 torch_dist load_checkpoint(): asks is_te_min_version() on every load, which raises without TE"),
    # --- megatron-core modules only the training loop reaches ---
    Patch(f"{_MC}.distributed.param_and_grad_buffer.torch", _CORE_TORCH_VIEW,
          "_ParamAndGradBuffer() allocates the DDP param/grad buffers on current_device()"),
    Patch(f"{_MC}.distributed.distributed_data_parallel.torch", _CORE_TORCH_VIEW,
          "--num-distributed-optimizer-instances > 1: DDP makes a cuda Stream for the inter-instance reduce"),
    Patch(f"{_MC}.optimizer.distrib_optimizer.torch", _CORE_TORCH_VIEW,
          "the distributed optimizer gathers its shards (checkpoints) into current_device() buffers"),
    Patch(f"{_MC}.optimizer.optimizer.torch", _CORE_TORCH_VIEW,
          "FP32Optimizer/MixedPrecisionOptimizer create _scale/found_inf with device='cuda'"),
    Patch(f"{_MC}.optimizer.grad_scaler.torch", _CORE_TORCH_VIEW,
          "--fp16: the loss scalers keep their scale, bounds and trackers in device='cuda' tensors"),
    Patch(f"{_MC}.optimizer.optimizer.clip_grad_by_total_norm_fp32",
          _cpu_clip_grad_by_total_norm_fp32,
          "optimizer.step()'s clip_grad_by_total_norm_fp32 asserts grads are torch.cuda.FloatTensor"),
    Patch(f"{_MC}.optimizer.optimizer.Float16OptimizerWithFloat16Params.__init__", _WrapOriginal(_cuda_type_names),
          "--bf16: the mixed-precision optimizer accepts only torch.cuda.* parameter type names"),
    Patch(f"{_MC}.optimizer.distrib_optimizer.DistributedOptimizer.__init__", _WrapOriginal(_cuda_type_names),
          "--use-distributed-optimizer: its shard groups accept only torch.cuda.* parameter type names"),
    Patch(f"{_MC}.optimizer.distrib_optimizer.DistributedOptimizer.get_parameter_state_dp_reshardable",
          _WrapOriginal(_no_step_in_bucket_state),
          "0.15 --use-distributed-optimizer --save: torch Adam's 0-dim step fails the bucket-slice assertion"),
    Patch(f"{_MC}.optimizer.distrib_optimizer.DistributedOptimizer.state_dict",
          _WrapOriginal(_state_dict_before_any_step),
          "--use-distributed-optimizer --load: asserts one torch Adam step over the still empty state"),
    Patch(f"{_MC}.optimizer.distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states",
          _WrapOriginal(_load_into_main_params),
          "--use-distributed-optimizer --load: copies into torch Adam's step (not saved), with autograd on"),
    Patch(f"{_MC}.optimizer.distrib_optimizer.DistributedOptimizer.load_state_dict",
          _WrapOriginal(_one_step_tensor_per_parameter),
          "--use-distributed-optimizer --load: one step tensor shared by all torch Adam states"),
    Patch(f"{_MC}.fp8_utils._quantize_param_shard_impl", _WrapOriginal(_no_fp8_params_to_quantize),
          "0.12 --use-distributed-optimizer: each step quantizes its (no) fp8 params, which raises without TE"),
    Patch(f"{_MC}.optimizer.clip_grads.torch", _CORE_TORCH_VIEW,
          "get_grad_norm_fp32()/count_zeros_fp32() accumulate into device='cuda' tensors"),
    Patch(f"{_MC}.dist_checkpointing.strategies.filesystem_async.torch", _CORE_TORCH_VIEW,
          "the torch_dist writer's preload_tensors() calls torch.cuda.synchronize() before copying to host"),
    Patch(f"{_MC}.dist_checkpointing.strategies.state_dict_saver.torch", _CORE_TORCH_VIEW,
          "the torch_dist save's reuse check and failure broadcast use device='cuda' flag tensors"),
    Patch(f"{_MC}.dist_checkpointing.strategies.fully_parallel.torch", _CORE_TORCH_VIEW,
          "the fully parallel save/load strategy calls torch.cuda.synchronize()"),
    Patch(f"{_MC}.dist_checkpointing.strategies.async_utils.torch", _CORE_TORCH_VIEW,
          "the save's request runner calls torch.cuda.synchronize() and makes current_device() tensors"),
    Patch(f"{_MC}.dist_checkpointing.exchange_utils.torch", _CORE_TORCH_VIEW,
          "the fully parallel load exchanges shards through device='cuda' buffers"),
    Patch(f"{_MC}.rerun_state_machine.torch", _CORE_TORCH_VIEW,
          "RerunStateMachine._save_state() reads torch.cuda.get_rng_state(); reductions on cuda"),
    Patch(f"{_MC}.fault_injector.torch", NamedCudaDeviceCpuTorchView(),
          "0.18+ --fault-injector-*: setup_fault_injection() broadcasts its plan in a current_device() tensor"),
    Patch(f"{_MC}.energy_monitor.torch", _CORE_TORCH_VIEW,
          "0.13+ --log-energy: setup() asks current_device() for NVML; lap() all-reduces device='cuda' tensors"),
    # --- process-wide (see above) ---
    Patch("torch.Tensor.cuda", _tensor_cuda,
          "get_model() model.cuda() / get_batch_on_this_tp_rank() .cuda(): keep tensors on CPU"),
)


# --------------------------------------------------------------------------------------------
# enable / disable
# --------------------------------------------------------------------------------------------


#: Targets in modules that only some Megatron-LM releases have (skipped where the module is absent).
_ONLY_SOME_RELEASES = frozenset({f"{_MT}.utils.common_utils.torch", f"{_MT}.models.dist_utils.torch",
                                 f"{_MC}.fault_injector.torch", f"{_MC}.energy_monitor.torch",
                                 f"{_MT}.checkpointing.fix_fp8_params_lose_precision_when_loading_dist_ckpt",
                                 f"{_MC}.optimizer.distrib_optimizer.DistributedOptimizer"
                                 ".get_parameter_state_dp_reshardable"})

_LOCK = threading.RLock()
_APPLIED: List[_Applied] = []
_OWNS_CORE_MODE = False


def _owner_and_attr(target: str) -> Tuple[Any, str]:
    """Like accelerator's ``_resolve`` but lets a real import error of the target's module
    (a missing dependency of megatron.training, say) through instead of masking it."""
    modname, attr = target.rsplit(".", 1)
    try:
        return importlib.import_module(modname), attr
    except ModuleNotFoundError as exc:
        if not (exc.name and modname.startswith(exc.name)):
            raise  # the module exists but one of its own imports is missing
        if target.startswith(_MT + "."):
            raise ImportError(
                f"{target}: megatron.training is not importable; it ships with a Megatron-LM "
                "source checkout (not the megatron-core wheel): put one on sys.path"
            ) from exc
    return _resolve(target)  # e.g. a class attribute such as torch.Tensor.cuda


def _target_exists(target: str) -> bool:
    """A module-level target's module, or a class attribute (a method some releases have), exists."""
    owner = target.rsplit(".", 1)[0]
    if _module_exists(owner):
        return True
    try:
        found, attr = _resolve(target)
    except (ImportError, AttributeError):
        return False
    return hasattr(found, attr)


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent is a module, not a package
        return False


def megatron_lm_cpu_mode_enabled() -> bool:
    """True while the Megatron-LM CPU-mode patches are applied."""
    return bool(_APPLIED)


def enable_megatron_lm_cpu_mode() -> None:
    """Turn on megatron-core's CPU mode, then apply :data:`MEGATRON_LM_CPU_PATCHES`.

    Idempotent. Imports ``megatron.training`` (raises ImportError, with nothing left patched,
    when no Megatron-LM checkout is importable).
    """
    global _OWNS_CORE_MODE
    with _LOCK:
        if _APPLIED:
            return
        _OWNS_CORE_MODE = not cpu_mode_enabled()
        enable_cpu_mode()
        try:
            install_megatron_lm_cpu_patches(_APPLIED)
        except BaseException:
            _restore_all()
            raise


def install_megatron_lm_cpu_patches(applied: List[_Applied], only: Tuple[str, ...] = ("",)) -> None:
    """Apply those of :data:`MEGATRON_LM_CPU_PATCHES` whose targets start with one of ``only`` (and exist in
    this release), recording each in ``applied``. Tests of megatron-core modules that only Megatron-LM's training
    loop reaches take the patches of those modules alone, without a Megatron-LM checkout."""
    for patch in MEGATRON_LM_CPU_PATCHES:
        if not patch.target.startswith(only):
            continue
        if patch.target in _ONLY_SOME_RELEASES and not _target_exists(patch.target):
            continue  # a module of other releases (megatron.core.fault_injector: 0.18+)
        value = patch.replacement
        build = value.build if isinstance(value, _WrapOriginal) else (lambda _original, value=value: value)
        install_patch(*_owner_and_attr(patch.target), build, applied)


def _restore_all() -> None:
    global _OWNS_CORE_MODE
    undo_patches(_APPLIED)
    if _OWNS_CORE_MODE:
        disable_cpu_mode()
        _OWNS_CORE_MODE = False


def disable_megatron_lm_cpu_mode() -> None:
    """Restore every original patched by :func:`enable_megatron_lm_cpu_mode`, and turn
    megatron-core's CPU mode off if that call turned it on. No-op when not enabled."""
    with _LOCK:
        if _APPLIED:
            _restore_all()


def describe_megatron_lm_cpu_patches() -> List[dict]:
    """The patch table as plain dicts (for logs and docs)."""
    return [{"target": p.target, "why": p.why} for p in MEGATRON_LM_CPU_PATCHES]


def with_fp16_loss_scaling(flags: List[str]) -> List[str]:
    """``flags`` in fp16 (with fp32 gradient accumulation, which ``--odyssey`` needs) with a dynamic loss scale that
    overflows and grows every few iterations of the tiny GPT (2^20 to start, doubled after 2 clean iterations,
    halved at each overflow): Megatron skips iterations 3 and 6 of 8 on PP=2 x DP=2 (core_r0.19.0: and 7)."""
    return [*flags, "--fp16", "--accumulate-allreduce-grads-in-fp32", "--initial-loss-scale", "1048576",
            "--loss-scale-window", "2", "--hysteresis", "1"]


def tiny_gpt_flags(train_iters: int, pipeline_parallel: int = 2, vocab_size: int = 128) -> List[str]:
    """Megatron-LM flags for a tiny Llama-style GPT on mock data that runs on CPU (gloo): the kernels
    this mode cannot run are switched off. Shared by the Megatron-LM tests and benchmarks.

    megatron-core 0.12-0.15's mock documents hold tokens up to 4095 (not reduced modulo the vocabulary, as from
    0.16 on): give it ``vocab_size=4096``."""
    return [
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "176",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
        "--global-batch-size", "8", "--train-iters", str(train_iters), "--lr", "1e-3", "--min-lr", "1e-4",
        "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.01", "--seed", "1234",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab_size),
        "--distributed-backend", "gloo", "--transformer-impl", "local", "--use-cpu-initialization",
        "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
        "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--attention-dropout", "0", "--hidden-dropout", "0",
        "--pipeline-model-parallel-size", str(pipeline_parallel), "--log-interval", "1",
        "--eval-iters", "0", "--eval-interval", "1000",
        # the data loaded in the main process: a worker forked while gloo's own thread holds a lock can deadlock
        # at its start (seen once: a rank waiting forever for the first batch)
        "--num-workers", "0",
    ]
