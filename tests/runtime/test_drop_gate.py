"""The drop gate (``runtime.drop_gate``): what a commit says, and when a pending drop is due, on a real store."""
from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatron_odyssey.runtime.agent import free_port
from megatron_odyssey.runtime.drop_gate import PendingDrop, commit_value, inside_key, parse_commit


@pytest.mark.parametrize("loss, inside", [(2.302585092994046, None), (0.1 + 0.2, 4), (1e-300, 0)])
def test_a_commit_carries_its_loss_exactly_and_the_step_to_say(loss: float, inside: int | None) -> None:
    value = commit_value(loss, inside)
    assert parse_commit(value.encode()) == (loss, inside)  # (repr: the loss round-trips bit for bit)
    assert (value == repr(loss)) == (inside is None)  # a commit without a drop is the loss, as before


def test_a_pending_drop_is_due_once_every_survivor_is_inside_or_the_bound_passed() -> None:
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    drop = PendingDrop(action=None, gen=2, step=5, decided=100.0, bound_s=40.0)
    assert drop.due(store, [0, 2, 3], now=101.0) is None
    store.set(inside_key(2, 5, 0), "5")
    store.set(inside_key(2, 5, 3), "6")  # (inside a later step counts too)
    store.set(inside_key(1, 5, 2), "5")  # another generation's key does not
    assert drop.due(store, [0, 2, 3], now=139.9) is None
    assert drop.due(store, [0, 2, 3], now=140.0) == (
        "rank(s) [2] did not reach step 5 within 40 s (the hard timeout): not waited for longer")
    store.set(inside_key(2, 5, 2), "5")
    assert drop.due(store, [0, 2, 3], now=101.0) == "every other rank is inside step 5"
    assert drop.when("every other rank is inside step 5", now=101.25) == (
        "fenced 1.25 s after the decision: every other rank is inside step 5")
    drop.rearm(3, 4, now=150.0)  # a recovery started generation 3 at step 4: its ranks have said nothing yet
    assert (drop.gen, drop.step) == (3, 4) and drop.due(store, [0, 2, 3], now=151.0) is None
    # the bound counts again from the new generation's start: a recovery longer than it fences nobody between steps
    assert drop.due(store, [0, 2, 3], now=189.9) is None
    assert drop.due(store, [0, 2, 3], now=190.0) == (
        "rank(s) [0, 2, 3] did not reach step 4 within 40 s (the hard timeout): not waited for longer")
    assert drop.when("x", now=190.0) == "fenced 90.00 s after the decision: x"  # (the report's wait: the decision's)
    assert drop.due(store, [], now=151.0) == "every other rank is inside step 4"  # (nobody to wait for)


def test_a_pending_drop_travels_to_the_standby_with_a_fresh_bound() -> None:
    drop = PendingDrop(action=None, gen=2, step=5, decided=100.0, bound_s=40.0)
    spec = json.loads(json.dumps(drop.to_json()))
    copy = PendingDrop.from_json(spec, action="the action", now=130.0)
    assert (copy.action, copy.gen, copy.step, copy.decided, copy.bound_s, copy.since) == (
        "the action", 2, 5, 100.0, 40.0, 130.0)
