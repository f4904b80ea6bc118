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
import threading
import time
from pathlib import Path
from typing import IO, Callable

from ..runtime.config import TrainConfig
from ..runtime.errors import STOP_LINE


class TrainingFailed(RuntimeError):
    """The job failed; ``stderr`` holds what the agent printed there (the ranks' errors), ``code`` the agent's exit
    code: 1 for a failure, 128 + N when stopped by signal N, or the training script's own code when it ended the job
    (``--fail ...,kind=exit,code=C``; Megatron-LM's rerun state machine), which ``odyssey train`` leaves with."""

    def __init__(self, message: str, stderr: str = "", code: int = 1):
        super().__init__(message)
        self.stderr = stderr
        self.code = code if code > 0 else 128 - code  # (an agent killed by signal N: -N)


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
    standby = "control" in cfg.extra
    cfg.save(cfg_path)
    cmd = [sys.executable, "-m", "megatron_odyssey.runtime.agent", "--config", str(cfg_path), "--workdir", str(workdir)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    if standby:  # probing a lost agent's store makes c10d log a C++ backtrace per attempt: keep errors only
        env.update(TORCH_SHOW_CPP_STACKTRACES="0", TORCH_CPP_LOG_LEVEL=os.environ.get("TORCH_CPP_LOG_LEVEL", "FATAL"))
    out = None if not quiet else subprocess.DEVNULL
    err: list[str] = []
    readers: list[threading.Thread] = []

    def start(args: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen(cmd + args, env=env, stdout=out, stderr=subprocess.PIPE, text=True, errors="replace")
        reader = threading.Thread(target=_relay, args=(proc.stderr, err, quiet), daemon=True)
        reader.start()
        readers.append(reader)
        return proc

    # both agents' stores on this machine; the standby's listens before the agent starts writing into it
    standby_agent = _start_standby(cfg, cfg_path, start, readers, err) if standby else None
    agent = start(["--quiet"] if quiet else [])
    if standby_agent is not None:
        _announce(cfg, agent.pid)
    code = agent.wait()
    if standby_agent is not None:
        code = job_exit_code(code, standby_agent.wait())
    for reader in readers:
        reader.join()
    text = "".join(err)
    if code:
        raise TrainingFailed(failure_message(code, text, workdir, quiet), text, code)
    if temporary and cfg.workdir == str(workdir):
        shutil.rmtree(workdir, ignore_errors=True)  # nothing in it is needed after a clean finish
    return text


#: Tries at the standby agent's store when its port was taken between choosing it and binding it (another job's
#: connection can get that port from the kernel meanwhile, on a busy machine).
STANDBY_TRIES = 3


def _start_standby(cfg: TrainConfig, cfg_path: Path, start: Callable[[list[str]], subprocess.Popen],
                   readers: list[threading.Thread], err: list[str]) -> subprocess.Popen:
    """Start the standby agent and wait until its store listens, or until it exits: the agent then connects at once.
    Before, both started together: under load a standby that heard of no agent within 2 s left (``Standby.watch``)
    and the agent waited 60 s for its store, then failed without the standby's reason (a CI flake)."""
    from ..runtime.control_plane import free_port, listening

    for attempt in range(1, STANDBY_TRIES + 1):
        primary_port, standby_port = free_port(), free_port()
        while standby_port == primary_port:
            standby_port = free_port()
        cfg.extra["control"].update(primary=f"127.0.0.1:{primary_port}", standby=f"127.0.0.1:{standby_port}")
        cfg.save(cfg_path)
        said_before = len(err)
        proc = start(["--standby"])
        while not listening(("127.0.0.1", standby_port), timeout_s=1.0):
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        else:
            return proc
        readers[-1].join()  # (its stderr, whole)
        said = "".join(err[said_before:])
        if "EADDRINUSE" in said and attempt < STANDBY_TRIES:
            line = (f"[odyssey] the standby agent's port {standby_port} was taken before it could listen: trying "
                    f"another\n")
            err.append(line)
            sys.stderr.write(line)
            continue
        raise TrainingFailed(f"training failed: the standby agent exited {proc.returncode} before its store "
                             f"listened on 127.0.0.1:{standby_port}:\n{said[-4000:]}", "".join(err),
                             proc.returncode or 1)
    raise AssertionError("unreachable")


def _announce(cfg: TrainConfig, pid: int) -> None:
    """Tell the standby which process is its agent, the moment it exists: an agent that dies while it imports is
    then found lost at once, and a live one slow to start is not taken for lost."""
    from ..runtime.control_plane import AGENT_PID_KEY, client, parse_address

    try:
        store = client(parse_address(cfg.extra["control"]["standby"]), 10.0)
        store.set(AGENT_PID_KEY, str(pid))
        store.check([AGENT_PID_KEY])
    except Exception as exc:  # noqa: BLE001 - a standby gone meanwhile: the agent finds it and says so
        print(f"[odyssey] could not tell the standby agent its agent's pid: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)


def _relay(stream: IO[str], sink: list[str], quiet: bool) -> None:
    """Live: a rank's error reaches the terminal when it happens, not at the end."""
    for line in stream:
        sink.append(line)
        if not quiet:
            sys.stderr.write(line)
            sys.stderr.flush()


def job_exit_code(agent: int, standby: int) -> int:
    """The agent's code when it ran the job to its end (the standby then ends with it); the standby's when
    it took over (the agent was killed, or deposed)."""
    from ..runtime.agent import DEPOSED_EXIT

    return standby if agent < 0 or agent == DEPOSED_EXIT else agent


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
