"""The recovery tests' job: 6 ranks (PP=2 x DP=3, or TP=2) train 4 steps of a small model; the saved
parameters are compared with an independent single-process reference (shared by test_recovery and
test_control_plane)."""
from __future__ import annotations

import json

import pytest
import torch

from megatron_odyssey.runtime.config import TrainConfig
from megatron_odyssey.standalone.launcher import launch

TOL = 1e-5
MODEL = dict(layers=6, hidden=32, heads=4, seq=16, global_batch=12, micro_batch=1, steps=4, seed=11)


def reference_run(fault_free_reference, **changes):
    """The fault-free run of MODEL (``changes``: other steps...), from the session's cache (tests/conftest.py)."""
    return fault_free_reference(TrainConfig(nproc=1, tp=1, pp=1, **{**MODEL, **changes}))


def run(tmp_path, fail, policy="auto", nproc=6, tp=1, pp=2, **extra):
    cfg = TrainConfig(nproc=nproc, tp=tp, pp=pp, fail=fail, policy=policy, save_params=str(tmp_path / "p.pt"),
                      report=str(tmp_path / "report.json"), **{**MODEL, **extra})
    launch(cfg, tmp_path / "run", quiet=True)
    return torch.load(tmp_path / "p.pt"), json.loads((tmp_path / "report.json").read_text())


def failure_story(report) -> str:
    """What each failure of the run was, for an assertion's message: a flaky count of failures says why."""
    return "; ".join(f"{f['ranks']} at step {f.get('step')} ({f.get('phase')}, {f.get('kind')}): "
                     f"{f.get('ended') or f.get('dropped') or f.get('error')}" for f in report["failures"]) \
        + f" | diagnoses: {[(d['step'], d['kind'], d['ranks'], d.get('evidence')) for d in report['diagnoses']]}"


def assert_exact(reference, params, report):
    assert set(params) == set(reference["params"])
    worst = max((params[k] - reference["params"][k]).abs().max().item() for k in params)
    assert worst < TOL, worst
    assert [s["loss"] for s in report["steps"]] == pytest.approx(reference["losses"], abs=TOL)
