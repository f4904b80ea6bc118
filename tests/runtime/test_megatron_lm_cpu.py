"""Megatron-LM CPU mode (megatron_lm.cpu_mode), with the megatron-core wheel only.

No Megatron-LM checkout is needed: the patches whose targets live in ``megatron.training`` are
only checked when a checkout is importable; everything else runs against real megatron-core
and torch. The end-to-end check (``pretrain_gpt.py`` on 2-4 gloo ranks) is manual, see the
module docstring.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from typing import Any, Dict, Tuple

import pytest
import torch

from megatron_odyssey.runtime import accelerator as acc
from megatron_odyssey.megatron_lm import cpu_mode as mlc

_TRAINING = "megatron.training."


def _has_megatron_training() -> bool:
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ModuleNotFoundError:
        return False


HAS_TRAINING = _has_megatron_training()
WHEEL_PATCHES: Tuple[acc.Patch, ...] = tuple(
    p for p in mlc.MEGATRON_LM_CPU_PATCHES if not p.target.startswith(_TRAINING)
    # a module of some releases only (megatron.core.fault_injector: 0.18+), skipped by enable where absent
    and (p.target not in mlc._ONLY_SOME_RELEASES or mlc._module_exists(p.target.rsplit(".", 1)[0]))
)


def _current(target: str) -> Any:
    return getattr(*acc._resolve(target))


def test_import_needs_neither_megatron_training_nor_core() -> None:
    code = (
        "import sys\n"
        "import megatron_odyssey.megatron_lm.cpu_mode as m\n"
        "assert m.MEGATRON_LM_CPU_PATCHES and callable(m.enable_megatron_lm_cpu_mode)\n"
        "assert 'megatron.training' not in sys.modules, 'megatron.training imported eagerly'\n"
        "assert 'megatron.core' not in sys.modules, 'megatron.core imported eagerly'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_patch_table_is_explicit() -> None:
    targets = [p.target for p in mlc.MEGATRON_LM_CPU_PATCHES]
    assert len(targets) == len(set(targets))
    assert not set(targets) & {p.target for p in acc.CPU_MODE_PATCHES}  # no double patching
    process_wide = [t for t in targets if not t.startswith("megatron.")]
    assert process_wide == ["torch.Tensor.cuda"]  # the only process-wide patch
    for patch in mlc.MEGATRON_LM_CPU_PATCHES:
        assert patch.why.strip() and "\n" not in patch.why and len(patch.why) <= 100, patch.target
        assert patch.replacement is not None


def test_wheel_targets_resolve() -> None:
    """Targets outside megatron.training exist in the installed megatron-core / torch."""
    assert WHEEL_PATCHES
    for patch in WHEEL_PATCHES:
        owner, attr = acc._resolve(patch.target)
        assert hasattr(owner, attr), patch.target


def test_enable_is_idempotent_and_disable_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the wheel-importable subset of the table: patched on enable (twice = once),
    originals (and megatron-core's CPU-mode state) back on disable."""
    monkeypatch.setattr(mlc, "MEGATRON_LM_CPU_PATCHES", WHEEL_PATCHES)
    core_was_on = acc.cpu_mode_enabled()
    core_before: Dict[str, Any] = {p.target: _current(p.target) for p in acc.CPU_MODE_PATCHES}
    originals: Dict[str, Any] = {p.target: _current(p.target) for p in WHEEL_PATCHES}
    assert "cuda" not in vars(torch.Tensor)  # inherited from TensorBase

    mlc.enable_megatron_lm_cpu_mode()
    try:
        assert mlc.megatron_lm_cpu_mode_enabled() and acc.cpu_mode_enabled()
        patched = {p.target: _current(p.target) for p in WHEEL_PATCHES}
        for patch in WHEEL_PATCHES:
            if isinstance(patch.replacement, mlc._WrapOriginal):  # built around the original at apply time
                # (or the original itself, where this release needs no wrapper: 0.15's distributed-optimizer step)
                assert getattr(patched[patch.target], "__wrapped__", patched[patch.target]) is \
                    originals[patch.target], patch.target
            else:
                assert patched[patch.target] is patch.replacement, patch.target
        mlc.enable_megatron_lm_cpu_mode()  # second call: nothing changes
        assert all(_current(t) is v for t, v in patched.items())

        # The process-wide patch: .cuda() keeps CPU tensors (and modules) where they are.
        t = torch.ones(3)
        assert t.cuda() is t and t.cuda(0, non_blocking=True) is t
        lin = torch.nn.Linear(2, 2)
        assert lin.cuda(torch.device("cpu")).weight.device.type == "cpu"
        # megatron-core modules see the CPU as the current device.
        import megatron.core.optimizer.optimizer as mopt

        assert mopt.torch.zeros(1, device="cuda").device.type == "cpu"
    finally:
        mlc.disable_megatron_lm_cpu_mode()

    assert not mlc.megatron_lm_cpu_mode_enabled()
    for target, original in originals.items():
        assert _current(target) is original, target
    assert "cuda" not in vars(torch.Tensor)
    assert acc.cpu_mode_enabled() is core_was_on
    assert all(_current(t) is v for t, v in core_before.items())
    import megatron.core.rerun_state_machine as rsm

    assert rsm.torch is torch
    mlc.disable_megatron_lm_cpu_mode()  # no-op when already off
    assert acc.cpu_mode_enabled() is core_was_on


def test_leaves_core_cpu_mode_on_when_it_was_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mlc, "MEGATRON_LM_CPU_PATCHES", WHEEL_PATCHES)
    was_on = acc.cpu_mode_enabled()
    acc.enable_cpu_mode()
    try:
        mlc.enable_megatron_lm_cpu_mode()
        mlc.disable_megatron_lm_cpu_mode()
        assert acc.cpu_mode_enabled()  # not ours to turn off
    finally:
        if not was_on:
            acc.disable_cpu_mode()


@pytest.mark.skipif(HAS_TRAINING, reason="a Megatron-LM checkout is importable")
def test_enable_without_checkout_fails_cleanly() -> None:
    was_on = acc.cpu_mode_enabled()
    with pytest.raises(ImportError, match="Megatron-LM"):
        mlc.enable_megatron_lm_cpu_mode()
    assert not mlc.megatron_lm_cpu_mode_enabled()
    assert "cuda" not in vars(torch.Tensor)
    assert acc.cpu_mode_enabled() is was_on


@pytest.mark.skipif(not HAS_TRAINING, reason="needs a Megatron-LM checkout on sys.path")
def test_full_table_with_checkout() -> None:
    originals = {p.target: _current(p.target) for p in mlc.MEGATRON_LM_CPU_PATCHES}
    mlc.enable_megatron_lm_cpu_mode()
    try:
        import megatron.training.training as mtt

        assert getattr(mtt.initialize_megatron, "__wrapped_for_cpu__", False)
        assert mtt.initialize_megatron.__wrapped__ is originals[f"{_TRAINING}training.initialize_megatron"]
        assert mtt.torch.cuda.device_count() == 1
    finally:
        mlc.disable_megatron_lm_cpu_mode()
    for target, original in originals.items():
        assert _current(target) is original, target


def test_training_cuda_view_is_the_cpu() -> None:
    view = mlc.TrainingCpuTorchView()
    assert view.cuda.device_count() == 1
    assert view.cuda.current_device() == torch.device("cpu")
    view.cuda.set_device(3)  # no-op
    stream = view.cuda.Stream()
    stream.wait_stream(view.cuda.current_stream())
    with view.cuda.stream(stream):
        assert view.tensor([1.0], device="cuda").device.type == "cpu"
    assert view.cuda.is_available() == torch.cuda.is_available()  # falls through


def test_dataset_helpers_load_from_the_wheel() -> None:
    """The megatron-core wheel ships the compiled index builders: no make/pybind11 needed."""
    path = mlc._find_shipped_helpers()
    assert path is not None and "helpers_cpp" in path
    helpers = mlc.load_dataset_helpers()
    assert hasattr(helpers, "build_sample_idx_int32") and hasattr(helpers, "build_blending_indices")


def test_cpu_clip_grad_matches_torch() -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    for p in params:
        p.grad = torch.randn_like(p) * 10
    expected = [p.grad.clone() for p in params]
    total = torch.linalg.vector_norm(torch.cat([g.flatten() for g in expected])).item()
    mlc._cpu_clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=total)
    coeff = 1.0 / (total + 1.0e-6)
    for p, g in zip(params, expected):
        torch.testing.assert_close(p.grad, g * coeff)
    # Below the threshold: untouched.
    before = [p.grad.clone() for p in params]
    mlc._cpu_clip_grad_by_total_norm_fp32(params, max_norm=1e9, total_norm=1.0)
    for p, g in zip(params, before):
        assert torch.equal(p.grad, g)


def test_describe() -> None:
    rows = mlc.describe_megatron_lm_cpu_patches()
    assert [r["target"] for r in rows] == [p.target for p in mlc.MEGATRON_LM_CPU_PATCHES]
