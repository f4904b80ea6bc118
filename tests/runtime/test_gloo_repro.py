"""``scripts/gloo_send_not_woken.py``, the reproduction to file upstream, still shows what it says: a send to a peer
that stopped after posting its receive is not woken by the peer's death; one to a peer that stopped before is."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_the_reproduction_shows_the_send_that_a_dead_peer_does_not_wake(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(SCRIPTS))  # (spawned ranks get this path too: they import the script by name)
    repro = importlib.import_module("gloo_send_not_woken")
    repro.WAIT_S = 5.0  # (the script's 15 s; the group's timeout is 60 s)
    ended, said = repro.case(posted=False)
    assert ended and said.startswith("raised "), said
    ended, said = repro.case(posted=True)
    assert not ended, said  # (once gloo wakes it, the script exits 0, and megatron_odyssey.runtime.stuck_call may go)
