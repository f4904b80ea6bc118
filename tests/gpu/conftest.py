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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    """A failed test's job logs (every rank's, the launcher's, the agent's: ``*.log``, ``*.json``, ``*.txt`` under
    its ``tmp_path``) packed beside ``ODYSSEY_GPU_FAILURES``: the assertion shows a log's last 4000 characters, the
    real cause is often a rank's earlier line, and the device machine is gone after the call."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        _keep_logs(item)


def _keep_logs(item: pytest.Item) -> None:
    import os
    import re
    import tarfile
    from pathlib import Path

    failures, tmp = os.environ.get("ODYSSEY_GPU_FAILURES"), getattr(item, "funcargs", {}).get("tmp_path")
    if not failures or tmp is None:
        return
    name = re.sub(r"[^A-Za-z0-9._-]", "_", item.name)[:120]
    with tarfile.open(Path(failures).parent / f"logs-{name}.tgz", "w:gz") as tar:
        for path in sorted(Path(tmp).rglob("*")):
            if path.is_file() and path.suffix in (".log", ".json", ".txt") and path.stat().st_size < 8 << 20:
                tar.add(path, arcname=str(path.relative_to(tmp)))
