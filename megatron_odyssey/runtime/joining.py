"""Ranks that join a running job: a repaired machine, or spot capacity coming back.

A joining rank needs only the job's address (the agent's store, ``HOST:PORT``; ``odyssey train`` writes it to
``<workdir>/agent.address``): it reads the job's config from the store, announces itself (``JOINING_KEY``,
appended ``rank:pid;``), beats like any rank, and waits. The agent admits it at a step boundary when the
planner (``planning.join``, Eq. 8) prefers filling a dead place or reconfiguring onto every node to holding it
as a standby: it re-plans like a rebalance, with the joining rank in the next generation's plan and the
transfers that bring it its stage's weights and Adam state from live replicas, and tells it which generation
(``ADMIT_KEY``). From there it is a rank like the others.

``python -m megatron_odyssey.runtime.joining --address HOST:PORT --rank R`` (or ``odyssey join``) starts one.
For ``odyssey train --rejoin R@S`` the agent starts one the same way when the job starts; it sets itself up
(imports, dataset) and asks to join once step S is committed and rank R is dead (``REJOIN_KEY``): a
repaired machine that comes back ready at a known time, so tests and the demo do not depend on how long a
Python process takes to import torch on a loaded machine.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from .errors import GIVEUP_KEY, stop_now

JOINING_KEY = "odyssey/joining"  # appended "rank:pid;" by every rank that asks to join ("rank:pid:launched;" when
# a launcher of odyssey-launch --join supervises it: its exits are reported in the store, like a remote machine's)
ADMIT_KEY = "odyssey/admit/{}"  # the generation the rank is admitted into (or "refused: why")
REJOIN_KEY = "odyssey/rejoin/{}"  # --rejoin: the agent's signal that rank R's machine is back
CONFIG_KEY = "odyssey/config"  # the job's TrainConfig as JSON (odyssey train's agent, or a Megatron-LM job's rank 0)
ADDRESS_FILE = "agent.address"  # in the job's workdir: HOST:PORT of the agent's store


def read_job_config(store: Any) -> Any:
    """The running job's TrainConfig, from its agent's store (``CONFIG_KEY``)."""
    from .config import TrainConfig

    return TrainConfig(**json.loads(store.get(CONFIG_KEY)))


@dataclass
class PublishedConfig:
    """The running job's TrainConfig for a launcher that starts before training does: None until rank 0 (or the
    agent) publishes it, read once then (it never changes; a standby that takes over publishes the same one)."""

    config: Any = None

    def get(self, store: Any) -> Any:
        """(``store``: the agent's, or the standby's once it took over.)"""
        if self.config is None and store.check([CONFIG_KEY]):
            self.config = read_job_config(store)
        return self.config


def announce(store: Any, ident: int, launched: bool = False) -> None:
    store.append(JOINING_KEY, f"{ident}:{os.getpid()}{':launched' if launched else ''};")


def join_requests_in(text: str) -> list[tuple[int, int, bool]]:
    """``JOINING_KEY``'s entries: (rank, pid, whether a launcher supervises it)."""
    out = []
    for item in filter(None, text.split(";")):
        rank, pid, *how = item.split(":")
        out.append((int(rank), int(pid), how == ["launched"]))
    return out


def wait_for_admission(store: Any, ident: int, poll_s: float = 0.05) -> tuple[int, dict[str, Any]]:
    """Block until the agent admits this rank; returns the generation and its plan message. Leaves when the
    agent refuses it, gives up on the job, or is gone (the job ended without needing it)."""
    from .generation import keys
    from .plan_message import decode_plan_message

    key = ADMIT_KEY.format(ident)
    while True:
        try:
            if store.check([key]):
                value = store.get(key).decode()
                if value.startswith("refused"):
                    stop_now(ident, f"the agent did not admit this rank: {value}", 1)
                gen = int(value)
                return gen, decode_plan_message(store.get(keys(gen)["plan"]))
            if store.check([GIVEUP_KEY]):
                stop_now(ident, f"the job stopped before this rank was admitted: {store.get(GIVEUP_KEY).decode()}", 1)
        except (RuntimeError, ConnectionError) as exc:  # the agent's store is gone: the job is over
            stop_now(ident, f"the job ended before this rank was admitted ({type(exc).__name__})", 0)
        time.sleep(poll_s)


@dataclass
class JoinRecord:
    """One entry of the report's ``"joins"``."""

    ranks: list[int]
    step: int  # the step after which the planner decided
    policy: str  # planning.join.JOIN_ACTIONS
    reason: str = ""
    options: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float | None = None  # when the planner decided, on the report's clock
    replan: Any = None  # the agent's record of the generation that admitted them (its timings)

    @property
    def action(self) -> str:  # (how the agent's re-plan names what it does)
        return f"join ({self.policy})"

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items() if k != "replan"}
        if self.replan is not None:
            out.update(step=self.replan.step, generation=self.replan.generation,
                       transfer_s=self.replan.transfer_s, recovery_s=self.replan.recovery_s or None)
        else:
            out.update(transfer_s=0.0, recovery_s=0.0)
        return out


class JoinRequests:
    """The agent's view of ``JOINING_KEY``: who asked to join (rank -> pid), read incrementally."""

    def __init__(self) -> None:
        self.seen = 0  # bytes of the key already parsed
        self.pending: dict[int, int] = {}
        self.launched: set[int] = set()  # ranks a launcher supervises (odyssey-launch --join), not seen by pid

    def poll(self, store: Any) -> dict[int, int]:
        """New requests since the last poll (two cheap round trips when there are none)."""
        if not store.check([JOINING_KEY]):
            return {}
        value = store.get(JOINING_KEY).decode()
        new, self.seen = value[self.seen:], len(value)
        out = {}
        for rank, pid, launched in join_requests_in(new):
            out[rank] = pid
            if launched:
                self.launched.add(rank)
            else:
                self.launched.discard(rank)
        self.pending.update(out)
        return out


def publish_job(store: Any, cfg_json: str, workdir: str | os.PathLike, port: int) -> None:
    """What a joining rank needs: the config in the store, the address beside the logs."""
    store.set(CONFIG_KEY, cfg_json)
    with open(os.path.join(workdir, ADDRESS_FILE), "w") as f:
        f.write(f"127.0.0.1:{port}\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="join a running odyssey job as rank R (a machine that came back)")
    parser.add_argument("--address", required=True, help="HOST:PORT of the job's agent (<workdir>/agent.address)")
    parser.add_argument("--rank", type=int, required=True, help="the rank to join as (a dead rank's, or a new one)")
    parser.add_argument("--when", default=None, help=argparse.SUPPRESS)  # --rejoin: ready early, ask when this key is set
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as the agent's own ranks (several share the cores)
    os.environ.setdefault("TORCH_SHOW_CPP_STACKTRACES", "0")
    from .control_plane import client, listening, parse_address
    from .errors import dump_stacks_on_signals

    dump_stacks_on_signals()
    host, port = parse_address(args.address)
    try:
        if not listening((host, port), timeout_s=5):  # a wrong address fails now, not in 30 s
            raise ConnectionRefusedError("nothing listens there")
        store = client((host, port), 30)
        cfg = read_job_config(store)
    except Exception as exc:  # noqa: BLE001 - say what went wrong on the terminal, not a traceback
        print(f"odyssey join: cannot reach the job at {args.address}: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(2)
    if args.rank < 0:
        parser.error(f"--rank must be >= 0, got {args.rank}")
    store.set_timeout(timedelta(seconds=cfg.timeout_s))
    from ..standalone.trainer import StandaloneRank

    try:
        rank = StandaloneRank(cfg, args.rank, store, (host, port))
    except Exception as exc:  # noqa: BLE001
        stop_now(args.rank, f"start-up failed: {type(exc).__name__}: {exc}", 1)
    if args.when:  # started by the agent for --rejoin: set up in advance, "comes back" when the agent says so
        wait_for_key(store, args.when, args.rank)
    rank.join_job()


def wait_for_key(store: Any, key: str, ident: int, poll_s: float = 0.05) -> None:
    while True:
        try:
            if store.check([key]):
                return
            if store.check([GIVEUP_KEY]):
                stop_now(ident, "the job stopped before this rank was due to come back", 1)
        except (RuntimeError, ConnectionError) as exc:
            stop_now(ident, f"the job ended before this rank was due to come back ({type(exc).__name__})", 0)
        time.sleep(poll_s)


if __name__ == "__main__":
    main()
