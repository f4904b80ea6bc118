"""The agent's record of committed steps, on disk as it goes (one JSON line per step), not in memory.

A job of 10,000 steps would otherwise hold 10,000 records until the end, and a job that ends badly would
leave none: the lines are flushed as steps commit, and the final report is assembled from them.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class StepLog:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self.highest = -1  # the highest step ever committed (a lower one committed again was redone)
        self.count = 0
        self.last: dict[str, Any] | None = None

    def was_trained(self, step: int) -> bool:
        return step <= self.highest

    def append(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.highest = max(self.highest, int(record["step"]))
        self.count += 1
        self.last = record

    @staticmethod
    def read(path: Path) -> list[dict[str, Any]]:
        """The records of a step log file, in the order written."""
        with Path(path).open() as f:
            return [json.loads(line) for line in f if line.strip()]

    def records(self) -> list[dict[str, Any]]:
        """Every step once, in order; a step trained again after a restart keeps its last record."""
        by_step: dict[int, dict[str, Any]] = {}
        with self.path.open() as f:
            for line in f:
                if line.strip():
                    record = json.loads(line)
                    by_step[int(record["step"])] = record
        return [by_step[s] for s in sorted(by_step)]


def resident_mb() -> float | None:
    """This process's resident memory (MB), from /proc (None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 1e6
