"""A store client that asks the store something every few milliseconds and keeps how long each answer took: what a
rank's heartbeat sees while the store is busy (``benchmarks/bench_store_stalls.py``, ``bench_store_names.py``)."""
from __future__ import annotations

import threading
import time
from typing import Any


class Pinger:
    """Pings ``store`` (its own client: a store client is not shared between threads) from a thread of its own, from
    :meth:`start` until :meth:`stop`; ``waits``: (seconds since :attr:`start_at`, that ping's wait), in order."""

    def __init__(self, store: Any, every_s: float = 0.005):
        self.store, self.every_s = store, every_s
        self.waits: list[tuple[float, float]] = []
        self.start_at = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="odyssey-store-pinger")

    def start(self) -> "Pinger":
        self.start_at = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, float]]:
        self._done.set()
        self._thread.join()
        return self.waits

    def since_start(self) -> float:
        return time.monotonic() - self.start_at

    def _run(self) -> None:
        while not self._done.is_set():
            t = time.monotonic()
            self.store.check(["x"])
            self.waits.append((t - self.start_at, time.monotonic() - t))
            time.sleep(self.every_s)
