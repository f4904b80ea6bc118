"""GPU tests: marked ``gpu`` and skipped where no CUDA device is visible (CI). Their runs are recorded
in docs/benchmarks.md (command, device, result)."""
from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each failure written out as it happens (``ODYSSEY_GPU_FAILURES``, a file; the device script sets it under the
    device tool's $OUT): a device run stopped at its time limit never prints pytest's summary, and its tree is gone."""
    import os

    path = os.environ.get("ODYSSEY_GPU_FAILURES")
    if getattr(report, "node", None) is not None:  # pytest-xdist's controller, passing on what its worker wrote
        return
    if path and report.failed:
        with open(path, "a") as out:
            out.write(f"==== {report.nodeid} ({report.when}, pid {os.getpid()})\n{report.longreprtext}\n\n")
