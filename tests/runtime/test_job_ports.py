"""The test helpers' ports and processes: the workers of one pytest-xdist run never share a port, an address said
to be gone refuses at once, a stand-in rank is asleep when a test reads its state."""
from __future__ import annotations

import pytest

from megatron_odyssey.testing.ports import BLOCK, BLOCKS, HIGHEST, LOWEST, job_port


def _ports(monkeypatch: pytest.MonkeyPatch, run: str, worker: str) -> set[int]:
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", run)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    # a job given port p also listens on p + 1 and p + 2
    return {job_port(offset) + k for offset in range(BLOCK - 2) for k in range(3)}


@pytest.mark.parametrize("run", ["3f2a9c", "e0b71d54", "x"])
def test_each_worker_of_a_run_has_ports_of_its_own(monkeypatch: pytest.MonkeyPatch, run: str) -> None:
    blocks = [_ports(monkeypatch, run, f"gw{i}") for i in range(BLOCKS)]
    assert all(len(b) == BLOCK for b in blocks)
    assert len(set().union(*blocks)) == BLOCK * BLOCKS  # pairwise disjoint
    assert min(map(min, blocks)) == LOWEST and max(map(max, blocks)) == HIGHEST - 1


def test_an_offset_past_the_block_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert LOWEST <= job_port(0) < HIGHEST
    for offset in (-1, BLOCK - 2):
        with pytest.raises(ValueError, match=f"port offset {offset} is outside"):
            job_port(offset)


def test_a_refusing_address_refuses_at_once_and_no_one_else_can_take_it() -> None:
    import socket

    from megatron_odyssey.testing.processes import refusing_address

    with refusing_address() as (host, port):
        with socket.socket() as other:
            with pytest.raises(OSError):
                other.bind((host, port))
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((host, port), timeout=5)


def test_a_sleeper_is_returned_asleep() -> None:
    from megatron_odyssey.runtime.process_probe import sample
    from megatron_odyssey.testing.processes import start_sleeper

    proc = start_sleeper(60)
    try:
        assert sample(proc.pid).state == "S"
    finally:
        proc.kill()
        proc.wait()
