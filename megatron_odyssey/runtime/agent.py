"""The per-machine agent: hosts the control store and starts the local ranks.

It runs in a fresh process (``python -m megatron_odyssey.runtime.agent``), imports torch and
megatron-core once, creates the TCP store (so the store survives any rank's death), then forks one
process per rank; the children inherit the imported modules, which turns ~5-10 s of import per
rank into none. The agent knows every rank's pid and exit code, which is what failure handling
builds on.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

from .config import TrainConfig


def preload(sleep_mode: bool) -> None:
    """Import what every rank needs before forking (the point of the agent)."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    if not sleep_mode:
        from . import accelerator, data, model  # noqa: F401


def _rank_main(cfg_path: str, rank: int, port: int, log_path: str, echo: bool) -> None:
    """Body of a forked rank: own log file, own store client, then train."""
    import torch
    import torch.distributed as dist

    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    if not echo:
        os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    torch.set_num_threads(1)
    cfg = TrainConfig.load(cfg_path)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=cfg.timeout_s))
    from .trainer import run

    run(cfg, rank, store)


def run_agent(cfg_path: Path, workdir: Path, echo_rank0: bool = True) -> int:
    import torch.distributed as dist

    cfg = TrainConfig.load(cfg_path)
    plan = cfg.validate()
    world = len(plan.live_nodes()) * cfg.tp
    preload(cfg.sleep_forward_s is not None)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=cfg.timeout_s))
    ctx = mp.get_context("fork")
    procs = []
    for rank in range(world):
        p = ctx.Process(target=_rank_main, args=(str(cfg_path), rank, store.port, str(workdir / f"rank{rank}.log"),
                                                 echo_rank0 and rank == 0), name=f"rank{rank}")
        p.start()
        procs.append(p)
    codes = wait_all(procs)
    failed = [(r, c) for r, c in enumerate(codes) if c]
    for rank, code in failed:
        tail = (workdir / f"rank{rank}.log").read_text().strip().splitlines()[-15:]
        print(f"rank {rank} exited {code}:\n  " + "\n  ".join(tail), file=sys.stderr)
    return 1 if failed else 0


def wait_all(procs: list) -> list[int]:
    """Wait for every rank; once one fails, give the rest a moment to notice, then stop them."""
    deadline = None
    while True:
        codes = [p.exitcode for p in procs]
        if all(c is not None for c in codes):
            return [int(c) for c in codes]
        if deadline is None and any(c not in (None, 0) for c in codes):
            deadline = time.monotonic() + 10.0
        if deadline is not None and time.monotonic() > deadline:
            for p in procs:
                if p.exitcode is None:
                    p.kill()
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="odyssey agent: hosts the store and runs the local ranks")
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--quiet", action="store_true", help="do not echo rank 0's output")
    args = parser.parse_args(argv)
    sys.exit(run_agent(args.config, args.workdir, echo_rank0=not args.quiet))


if __name__ == "__main__":
    main()
