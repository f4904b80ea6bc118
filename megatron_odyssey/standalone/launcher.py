"""``odyssey train``: validate the job, then hand it to the agent (a fresh process that hosts the
store and starts the ranks: forked on the CPU, spawned on an accelerator).

It does not run under torchrun (``NOT_UNDER_TORCHRUN`` says why and what to run instead).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..runtime.config import TrainConfig
from ..runtime.errors import STOP_LINE


class TrainingFailed(RuntimeError):
    """The job failed; ``stderr`` holds what the agent printed there (the ranks' errors)."""

    def __init__(self, message: str, stderr: str = ""):
        super().__init__(message)
        self.stderr = stderr


def launch(cfg: TrainConfig, workdir: str | Path | None = None, quiet: bool = False) -> str:
    """Run the job to completion on this machine; raises TrainingFailed with the failing ranks' errors.
    The agent's stderr (errors, with tracebacks) is shown on the terminal as it comes unless ``quiet``,
    and returned. Without ``workdir`` the logs and checkpoints go to a temporary folder, removed when
    the job succeeds and kept (and named) when it fails."""
    cfg.validate()  # reject bad plans and flags before any process starts
    temporary = workdir is None
    workdir = Path(workdir or tempfile.mkdtemp(prefix="odyssey-train-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if cfg.workdir is None:
        cfg.workdir = str(workdir)  # checkpoints go next to the logs
    cfg_path = workdir / "config.json"
    cfg.save(cfg_path)
    cmd = [sys.executable, "-m", "megatron_odyssey.runtime.agent", "--config", str(cfg_path), "--workdir", str(workdir)]
    if quiet:
        cmd.append("--quiet")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=None if not quiet else subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, errors="replace")
    err = []
    for line in proc.stderr:  # live: a rank's error reaches the terminal when it happens, not at the end
        err.append(line)
        if not quiet:
            sys.stderr.write(line)
            sys.stderr.flush()
    code = proc.wait()
    text = "".join(err)
    if code:
        raise TrainingFailed(failure_message(code, text, workdir, quiet), text)
    if temporary and cfg.workdir == str(workdir):
        shutil.rmtree(workdir, ignore_errors=True)  # nothing in it is needed after a clean finish
    return text


def failure_message(code: int, stderr: str, workdir: Path, quiet: bool) -> str:
    """One line a user can act on: the agent's reason for stopping (the ranks' tracebacks were shown
    above it as they happened), and where the rank logs are kept."""
    reasons = [line[len(STOP_LINE):].strip() for line in stderr.splitlines() if line.startswith(STOP_LINE)]
    reason = reasons[-1] if reasons else f"the agent exited {code}"
    where = f"rank logs kept in {workdir}"
    if quiet:
        return f"training failed: {reason}; {where}:\n{stderr[-12000:]}"
    return f"training failed: {reason} (the error is above; {where})"


def is_torchrun_worker() -> bool:
    """Started by torchrun (or another launcher that sets its environment) as one of several workers."""
    return "RANK" in os.environ and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ


#: Why ``odyssey train`` refuses to run as a torchrun worker (it used to, and then waited for ever).
NOT_UNDER_TORCHRUN = (
    "odyssey train starts its own agent and ranks and cannot run as a torchrun worker (torchrun stops every "
    "worker when one dies, and nothing would commit steps): run `odyssey train --nproc N` directly on one "
    "machine; across machines, run Megatron-LM's pretrain_gpt.py with --odyssey under odyssey-launch")
