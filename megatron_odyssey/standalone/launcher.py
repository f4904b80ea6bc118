"""``odyssey train``: validate the job, then hand it to the agent (a fresh process that hosts the
store and starts the ranks: forked on the CPU, spawned on an accelerator).

Under torchrun (``RANK`` in the environment) the command instead runs as that one rank and meets
the others at ``MASTER_ADDR:MASTER_PORT``, torchrun's agent store, so multi-node launches work
unchanged.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from datetime import timedelta
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
    return "RANK" in os.environ and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ


def run_under_torchrun(cfg: TrainConfig) -> None:
    """One rank of a torchrun launch; the store is torchrun's agent store at MASTER_ADDR:MASTER_PORT."""
    import torch.distributed as dist

    from .trainer import run

    cfg.validate()
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=cfg.timeout_s))
    run(cfg, int(os.environ["RANK"]), store, (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
