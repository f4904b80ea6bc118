"""``odyssey train`` / ``odyssey demo`` as a user meets them: flags mean the same in both, the
temporary folder does not pile up, a failed job says why on the terminal, and the demo's report
explains itself. Real processes; tiny jobs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from megatron_odyssey.runtime.config import TrainConfig  # noqa: E402
from megatron_odyssey.standalone.launcher import TrainingFailed, launch  # noqa: E402
from megatron_odyssey.standalone.report_view import explain_failure, plot_report, print_summary  # noqa: E402

TINY = dict(nproc=2, pp=1, layers=2, hidden=32, heads=4, seq=16, global_batch=4, micro_batch=1, steps=2)


def odyssey(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_odyssey.cli", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_demo_flags_mean_what_train_gives_them(tmp_path: Path) -> None:
    """``--fail`` replaces the demo's built-in faults (appending them would name rank 5 of a 4-rank job
    and be refused), and ``--report`` is where the report (and its picture) goes."""
    report = tmp_path / "mine.json"
    run = odyssey("demo", "--out", str(tmp_path / "demo"), "--nproc", "4", "--layers", "4", "--steps", "3",
                  "--global-batch", "8", "--fail", "step=1,rank=3,phase=forward,kind=kill", "--report", str(report),
                  cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(report.read_text())
    assert [f["ranks"] for f in data["failures"]] == [[3]]
    assert data["max_param_diff_vs_fault_free"] < 1e-5
    assert report.with_suffix(".png").stat().st_size > 10_000
    assert not (tmp_path / "demo" / "report.json").exists()
    said = " ".join(run.stdout.split())  # (rich wraps lines at the terminal's width)
    assert "Eq. 8 score" in said and "from the plan cache" in said


def test_a_clean_run_leaves_no_temporary_folder_and_a_failed_one_names_its_logs(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    launch(TrainConfig(**TINY), quiet=True)
    assert not list(tmp_path.glob("odyssey-train-*"))

    bad = tmp_path / "garbage"  # a dataset prefix whose files exist but are not a Megatron dataset
    bad.with_suffix(".bin").write_bytes(b"x" * 64)
    bad.with_suffix(".idx").write_bytes(b"not an index")
    with pytest.raises(TrainingFailed) as failed:
        launch(TrainConfig(**TINY, data_path=str(bad)), quiet=True)
    kept = list(tmp_path.glob("odyssey-train-*"))
    assert len(kept) == 1
    first = str(failed.value).splitlines()[0]
    assert first.startswith("training failed: rank ") and "during start-up" in first and str(kept[0]) in first


FAILURE = {"ranks": [5], "step": 3, "phase": "backward", "policy": "reroute", "decision_s": 2e-5, "cached": True,
           "time_to_next_failure_s": 1.8, "mtbf_hours": 0.0035,
           "candidates": [
               {"policy": "reroute", "step_time_s": 0.0689, "transition_time_s": 0.2, "score": 206.5, "feasible": True},
               {"policy": "reconfigure", "step_time_s": 0.0588, "transition_time_s": 0.5, "score": 196.5,
                "feasible": True},
               {"policy": "restart", "step_time_s": 0.0588, "transition_time_s": 40.0, "score": 0.0, "feasible": True}]}


def test_each_decision_is_explained_in_eq8_terms() -> None:
    line = explain_failure(FAILURE, global_batch=16)
    assert "reroute[/], Eq. 8 score 206.5 vs reconfigure 196.5, restart 0" in line
    # 0.0689 / 0.0588 - 1 = 17.2 %: reconfigure's faster steps lose to its longer transition
    assert "reconfigure's steps would be 17% faster, but its 0.5 s transition (vs 0.2 s) costs more" in line
    # 0.0035 h x 3600 / 1.8 s = 7 live devices; at the default MTBF the transition is negligible
    assert "(MTBF 0.0035 h / 7 devices; at 50,000 h reconfigure would win)" in line
    assert line.endswith("from the plan cache in 0.0 ms")


def test_a_recovery_another_one_cut_short_is_marked_in_the_summary() -> None:
    """A recovery that a drop (or a failure, a takeover) overtook before its first step ends where the next one
    began; the table says so, with a note, instead of showing the time as a finished recovery's."""
    from rich.console import Console

    times = {"detection_s": 0.5, "transfer_s": 0.0}
    cut = {**FAILURE, **times, "recovery_s": 1.25, "superseded_by": 3}
    whole = {**FAILURE, **times, "ranks": [2], "step": 4, "recovery_s": 0.75, "superseded_by": 0}
    console = Console(record=True, width=250)
    print_summary(console, {"failures": [cut, whole], "steps": []}, global_batch=16, wall_s=10.0)
    text = console.export_text()
    assert "1.25*" in text and "0.75*" not in text and "0.75" in text
    assert "*: cut short: another recovery began before this one's first step" in text


def test_the_plot_puts_each_failure_where_it_happened(tmp_path: Path) -> None:
    steps = [{"step": s, "loss": 5.0 - s / 10, "time_s": 0.2, "alive": 4 if s < 2 else 3, "policy": "initial",
              "wall_s": 1.0 + 0.2 * s + (0.5 if s >= 2 else 0.0)} for s in range(4)]
    failure = {**FAILURE, "ranks": [3], "step": 2, "wall_s": 1.3, "recovery_s": 0.45}
    report = {"steps": steps, "failures": [failure], "devices": {str(i): "cpu (gloo)" for i in range(4)},
              "host": {"cpu_cores": 2}, "config": {"nproc": 4, "pp": 2, "tp": 1, "layers": 4, "global_batch": 8},
              "reference_losses": [s["loss"] for s in steps]}
    fig = plot_report(report, tmp_path / "r.png", keep=True)
    throughput, devices, _ = fig.axes
    for ax in (throughput, devices):
        marks = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
        assert [ln.get_xdata()[0] for ln in marks] == [1.3]
    drop = devices.get_lines()[0]
    assert list(drop.get_xdata()) == [0.0, 1.3, 1.3, steps[-1]["wall_s"]]
    assert list(drop.get_ydata()) == [4, 4, 3, 3]
    assert all(float(t).is_integer() for t in devices.get_yticks())
    assert fig._suptitle.get_text() == "4 ranks (PP=2 x DP=2), 4 layers, global batch 8, on 2 CPU cores"
    assert any("4 ranks time-share 2 CPU cores" in t.get_text() for t in fig.texts)
    # throughput starts at step 0's commit: step 0 includes start-up
    assert min(throughput.get_lines()[0].get_xdata()) == steps[0]["wall_s"]
    assert (tmp_path / "r.png").stat().st_size > 10_000


def test_train_refuses_to_run_as_a_torchrun_worker(tmp_path: Path) -> None:
    """It used to run as one rank with no agent, and wait for ever for a commit."""
    env = dict(os.environ, RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", WORLD_SIZE="2")
    out = subprocess.run([sys.executable, "-m", "megatron_odyssey.cli", "train", "--steps", "1"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2, out.stderr
    assert "cannot run as a torchrun worker" in out.stderr and "odyssey-launch" in out.stderr
    assert "Traceback" not in out.stderr
