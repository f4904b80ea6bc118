"""Fixtures for every test folder."""

from __future__ import annotations

import os
from typing import Callable

import pytest


@pytest.fixture(scope="session")
def fault_free_reference(tmp_path_factory: pytest.TempPathFactory) -> Callable:
    """``fault_free_reference(cfg)``: the single-process fault-free run of ``cfg``'s model, data and steps
    (``megatron_odyssey.testing.reference``), run once per test session however many tests, modules or
    pytest-xdist workers ask for it."""
    from megatron_odyssey.testing.reference import cached_reference

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # each xdist worker has its own basetemp under the session's
    return lambda cfg: cached_reference(cfg, root / "fault-free-references")
