"""Fixed ports for the test jobs, one block of them per pytest-xdist worker.

A job listens on its master port and the two above it (``odyssey-launch``'s store and standby), so two jobs
running at once must not draw nearby ports. A port derived from each worker's pid (as before) gave the two
workers of a run overlapping ranges now and then, and a job failed with EADDRINUSE or a gloo rendezvous that
another job's rank answered. Each worker of a run now owns its own block; separate runs on one machine are
told apart by the run's id, by chance only.
"""
from __future__ import annotations

import os
import zlib

LOWEST, HIGHEST = 20000, 32000  # below Linux's ephemeral range (32768+), where any socket may hold a port
BLOCK = 2000  # ports of one worker: every test file's offsets stay below it
BLOCKS = (HIGHEST - LOWEST) // BLOCK


def job_port(offset: int) -> int:
    """The port ``offset`` into this worker's block (a job also uses the two ports above the one it is given)."""
    if not 0 <= offset <= BLOCK - 3:
        raise ValueError(f"port offset {offset} is outside a worker's block of {BLOCK} ports")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or str(os.getpid())
    return LOWEST + BLOCK * ((zlib.crc32(run.encode()) + index) % BLOCKS) + offset
