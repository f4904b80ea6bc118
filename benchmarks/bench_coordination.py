"""Coordination at scale: the agent's per-step commit and its recovery protocol with thousands of ranks.

    python benchmarks/bench_coordination.py [--ranks 64 512 4096] [--steps 20] [--write docs/benchmarks.md]
        [--plot docs/coordination.png]

We cannot start thousands of training processes here, but the coordination does not need them: the real
:class:`~megatron_odyssey.runtime.agent.Agent` (its detection, commit, planning and recovery code, unchanged)
supervises *fake ranks*, asyncio tasks that speak c10d's store wire protocol over their own connections
(``store_wire``; threads with real clients could not get past 512 ranks on two cores) and do, per step, what
``generation.GenerationRank`` does: append their *ready* share, add to the ready counter, block on the
commit; on an abort register for recovery, block on the next plan, join, block on *go*. They live in 8
*fake machines* (processes, one event loop each), each reporting its ranks' exits as ``odyssey-launch``'s
node agents do and sending their heartbeats (with progress) in one multi_set every 0.2 s. One fake rank
dies mid-run (its exit reported as -9, as a SIGKILL's).

Measured, per rank count:
- *commit*: the agent's time to commit a step once the last *ready* is in (``Agent.advance``: the ready
  counter, the shares in one get, the commit, the deletions), median over the steps, as wall time and as
  the agent thread's own CPU time (the wall time here also waits for two cores shared with every fake rank
  and the store server);
- *commit -> last rank has it*: the fan-out of the commit, which the single store server answers rank by
  rank (a wait's answer and a get each), median over the steps;
- *store server CPU per step*: the agent process's CPU outside the agent's thread, per step (c10d's server
  thread: every rank's requests and heartbeats, served one after another on a cluster as here);
- *recovery*: abort to sealed membership, to the plan published (includes planning), to the new
  generation's *go* (every survivor joined), from the failure record's phases.
Goal (issue): commit under 10 ms per step and recovery coordination under 2 s at 4096 ranks.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from docs_section import write_section
from store_wire import AsyncStore
from megatron_odyssey.launch import EXIT_KEY, EXITS_KEY, RemoteExits, RemoteRank
from megatron_odyssey.planning.plan import ExecutionPlan
from megatron_odyssey.runtime.agent import Agent
from megatron_odyssey.runtime.plan_message import decode_plan_message
from megatron_odyssey.runtime.config import TrainConfig
from megatron_odyssey.runtime.errors import ABORTED, STARTED_KEY
from megatron_odyssey.runtime.liveness import Progress, WAITING

START, END = "<!-- bench_coordination:start -->", "<!-- bench_coordination:end -->"


class FakeRank:
    """One rank's side of the protocol, without a model (``generation.GenerationRank`` minus the work), as an
    asyncio task on its own store connection (``store_wire``: the real wire protocol, not the real client;
    see there why)."""

    def __init__(self, rank_id: int, steps: int, kill_at: int | None, plans: dict[bytes, tuple[dict, set[int]]],
                 seen: dict[tuple[int, int], float]):
        self.rank_id, self.steps, self.kill_at, self.plans = rank_id, steps, kill_at, plans
        self.seen = seen  # (generation, step) -> when the machine's last rank learnt the commit
        self.store: AsyncStore | None = None
        self.progress = Progress()
        self.gen, self.code = 0, None

    async def run(self, port: int) -> None:
        self.store = await AsyncStore.connect("127.0.0.1", port)
        try:
            await self._run()
            self.code = 0 if self.code is None else self.code
        except Exception as exc:  # noqa: BLE001 - reported as this rank's exit
            print(f"fake rank {self.rank_id}: {type(exc).__name__}: {exc}", file=sys.stderr)
            self.code = 1
        # as launch.report_exit, which a rank's node agent calls
        await self.store.set(EXIT_KEY.format(self.rank_id), str(self.code))
        await self.store.append(EXITS_KEY, f"{self.rank_id}:{self.code};")
        await self.store.close()

    def _plan(self, raw: bytes) -> tuple[dict, set[int]]:
        """Every rank downloads the plan message; decoding it once per fake machine stands for the ranks'
        decoding in parallel on their own hosts (the same message decoded 512 times on one core is not)."""
        if raw not in self.plans:
            msg = decode_plan_message(raw)
            self.plans[raw] = (msg, set(ExecutionPlan.from_dict(msg["plan"]).live_nodes()))
        return self.plans[raw]

    async def _run(self) -> None:
        store = self.store
        await store.set(STARTED_KEY.format(self.rank_id), "1")  # past start-up: a failure is recovered from
        step = 0
        while step < self.steps:
            if self.kill_at == step:
                self.code = -9  # as SIGKILL-ed
                return
            g = f"odyssey/gen{self.gen}"
            self.progress.mark(step, "forward")
            await store.append(f"{g}/ready/{step}/shares", f"{self.rank_id}=0.0;")
            await store.add(f"{g}/ready/{step}/count", 1)
            self.progress.set_state(WAITING)
            if await store.get(f"{g}/commit/{step}") != ABORTED:
                self.seen[(self.gen, step)] = time.time()
                step += 1
                continue
            # aborted: register, wait for the next plan, join, wait for go
            await store.set(f"{g}/recover/{self.rank_id}", str(step - 1))
            nxt = f"odyssey/gen{self.gen + 1}"
            msg, live = self._plan(await store.get(f"{nxt}/plan"))
            if self.rank_id not in live:  # as GenerationRank.enter
                return
            self.gen += 1
            await store.set(f"{nxt}/join/{self.rank_id}", "1")
            await store.wait([f"{nxt}/go"])
            step = int(msg["resume_step"])


async def _machine(port: int, ranks: list[int], steps: int, victim: int) -> dict[tuple[int, int], float]:
    plans: dict[bytes, tuple[dict, set[int]]] = {}
    seen: dict[tuple[int, int], float] = {}
    fakes = [FakeRank(i, steps, steps // 2 if i == victim else None, plans, seen) for i in ranks]
    tasks = [asyncio.create_task(f.run(port)) for f in fakes]
    beats = await AsyncStore.connect("127.0.0.1", port)
    while not all(t.done() for t in tasks):
        alive = [f for f in fakes if f.code is None and f.store is not None]
        if alive:
            await beats.multi_set([f"odyssey/hb/{f.rank_id}" for f in alive], [f.progress.beat() for f in alive])
        await asyncio.sleep(0.2)
    for t in tasks:
        t.result()
    await beats.close()
    return seen


def machine(port: int, ranks: list[int], steps: int, victim: int, out: Any) -> None:
    """One fake machine (a process): its ranks as tasks of one event loop, and one heartbeat task for all."""
    out.put(asyncio.run(_machine(port, ranks, steps, victim)))


def measure(n: int, steps: int, machines: int = 8, pp: int = 4) -> dict:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
    dp = n // pp
    cfg = TrainConfig(nproc=n, pp=pp, layers=32, hidden=64, heads=4, seq=32, global_batch=2 * dp, micro_batch=1,
                      steps=steps, checkpoint_interval=0, heartbeat_timeout_s=120.0, timeout_s=600.0,
                      soft_timeout_s=200.0, hard_timeout_s=400.0, extra={"max_cached_failures": 0})
    victim = n // 2 + 1
    ctx = mp.get_context("spawn")
    share = -(-n // machines)
    seen = ctx.Queue()
    procs = [ctx.Process(target=machine, args=(store.port, list(range(m * share, min(n, (m + 1) * share))), steps,
                                               victim, seen), daemon=True) for m in range(machines) if m * share < n]
    for p in procs:
        p.start()
    exits = RemoteExits(store)
    work = Path(tempfile.mkdtemp(prefix="odyssey-coordination-"))
    agent = Agent(cfg, None, work, echo_rank0=False, procs={i: RemoteRank(store, i, exits) for i in range(n)},
                  store=store)
    agent.log = lambda msg: None  # the candidates' table per failure is not what we measure
    commits: list[float] = []
    cpu: list[float] = []  # the agent's own CPU time per commit: what the commit costs without contention
    advance = agent.advance

    committed_at: dict[tuple[int, int], float] = {}

    def timed_advance() -> None:
        before, t0, c0 = agent.next_step, time.perf_counter(), time.thread_time()
        advance()
        if agent.next_step != before:
            commits.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
            committed_at[(agent.gen, before)] = time.time()

    agent.advance = timed_advance
    t0, p0, a0 = time.perf_counter(), time.process_time(), time.thread_time()
    with contextlib.redirect_stdout(io.StringIO()):  # the agent's per-step lines
        code = agent.supervise()
    wall = time.perf_counter() - t0
    # the agent process's CPU outside the agent's own thread: c10d's store server thread (the plan cache's
    # thread is off here), which on a cluster serves every rank's requests one after another as here
    server_cpu = (time.process_time() - p0) - (time.thread_time() - a0)
    last_seen: dict[tuple[int, int], float] = {}
    for _ in procs:
        for key, t in seen.get(timeout=60).items():
            last_seen[key] = max(t, last_seen.get(key, 0.0))
    for p in procs:
        p.join(30)
    # from the end of the agent's commit to the moment the last rank has it (the store server answers every
    # rank's wait and get one after another)
    fan_out = [last_seen[k] - t for k, t in committed_at.items() if k in last_seen]
    steps_done = agent.steps.records()
    (failure,) = agent.failures
    phases = failure.phases
    return {"ranks": n, "code": code, "steps": len(steps_done), "wall_s": wall,
            "commit_ms": statistics.median(commits) * 1e3, "commit_p90_ms": sorted(commits)[int(0.9 * len(commits))] * 1e3,
            "commit_cpu_ms": statistics.median(cpu) * 1e3,
            "server_cpu_ms": server_cpu / max(1, len(steps_done)) * 1e3,
            "fan_out_ms": statistics.median(fan_out) * 1e3,
            "step_wall_ms": statistics.median(s["time_s"] for s in steps_done[1:]) * 1e3,
            "sealed_s": phases["sealed_s"], "published_s": phases["published_s"],
            "decision_s": failure.decision_s, "go_s": phases.get("joined_s") or float("nan"),
            "store_keys": steps_done[-1]["store_keys"]}


def commit_only(n: int, steps: int, pp: int = 4) -> dict:
    """The agent's own commit at ``n`` ranks without fake-rank threads competing for the CPU: every rank's
    share and the counter are put into the store as the ranks would (one client per 512 ranks), then the real
    ``Agent.advance`` commits the step; median over ``steps`` steps."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
    writers = [dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=300))
               for _ in range(-(-n // 512))]
    dp = n // pp
    cfg = TrainConfig(nproc=n, pp=pp, layers=32, hidden=64, heads=4, seq=32, global_batch=2 * dp, micro_batch=1,
                      steps=steps, checkpoint_interval=0, extra={"max_cached_failures": 0})
    exits = RemoteExits(store)
    agent = Agent(cfg, None, Path(tempfile.mkdtemp(prefix="odyssey-commit-")), echo_rank0=False,
                  procs={i: RemoteRank(store, i, exits) for i in range(n)}, store=store)
    wall, cpu = [], []
    with contextlib.redirect_stdout(io.StringIO()):
        for t in range(steps):
            for i in range(n):
                w = writers[i // 512]
                w.append(f"odyssey/gen0/ready/{t}/shares", f"{i}={0.001 * (i % 7)!r};")
            writers[0].add(f"odyssey/gen0/ready/{t}/count", n)
            t0, c0 = time.perf_counter(), time.thread_time()
            agent.advance()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
            assert agent.next_step == t + 1, "not committed"
    return {"ranks": n, "commit_ms": statistics.median(wall) * 1e3, "commit_cpu_ms": statistics.median(cpu) * 1e3,
            "store_keys": store.num_keys()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[64, 512, 4096])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--write", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument("--commit-only", type=int, nargs="+", default=None, metavar="RANKS",
                   help="only the agent's commit at these rank counts, every rank's share put in by a few clients")
    args = p.parse_args(argv)
    if args.commit_only:
        for n in args.commit_only:
            print(json.dumps(commit_only(n, args.steps)), flush=True)
        return 0
    # c10d reverse-resolves every new connection's address (for its log lines); this sandbox's DNS server
    # drops about one query in 25, and glibc's default 5 s resolver timeout then stalls that connect: with
    # thousands of clients, setting up took longer than the run. One second and one attempt keeps the
    # stalls short (only connecting is affected; no store operation resolves names).
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    rows = []
    for n in args.ranks:  # written after each size: a larger one that fails or is stopped keeps the smaller ones
        r = measure(n, args.steps)
        rows.append(r)
        print(json.dumps(r), flush=True)
        publish(args, rows)
    return 0 if all(r["code"] == 0 for r in rows) else 1


def publish(args: argparse.Namespace, rows: list[dict]) -> None:
    table = ["| ranks | commit (agent), median | p90 | agent CPU per commit | commit -> last rank has it | "
             "store server CPU per step | "
             "wall per step (incl. fake ranks) | abort -> sealed | -> plan published (planning) | -> go | "
             "store keys at the end |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    table += [f"| {r['ranks']:,} | {r['commit_ms']:.2f} ms | {r['commit_p90_ms']:.2f} ms | {r['commit_cpu_ms']:.2f} ms | "
              f"{r['fan_out_ms']:.1f} ms | {r['server_cpu_ms']:.1f} ms | {r['step_wall_ms']:.0f} ms | "
              f"{r['sealed_s']:.3f} s | {r['published_s']:.3f} s ({r['decision_s'] * 1e3:.0f} ms) | {r['go_s']:.3f} s | "
              f"{r['store_keys']} |" for r in rows]
    print("\n".join(table))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
        xs = [r["ranks"] for r in rows]
        a.plot(xs, [r["commit_ms"] for r in rows], "o-", label="agent's commit, wall (cores shared with fake ranks)")
        a.plot(xs, [r["commit_cpu_ms"] for r in rows], "s--", label="agent's CPU per commit")
        a.plot(xs, [max(r["fan_out_ms"], 0.05) for r in rows], "^-.", label="commit -> last rank has it")
        a.axhline(10, color="grey", ls="--", label="goal 10 ms")
        a.set(xscale="log", yscale="log", xlabel="ranks", ylabel="ms per step (medians)", title="Per-step commit")
        a.legend(fontsize=8)
        b.plot(xs, [r["go_s"] for r in rows], "o-", color="tab:red", label="abort -> every survivor joined")
        b.plot(xs, [r["published_s"] for r in rows], "s--", color="tab:orange", label="abort -> plan published")
        b.axhline(2, color="grey", ls="--", label="goal 2 s")
        b.set(xscale="log", xlabel="ranks", ylabel="seconds", title="Recovery coordination")
        b.legend()
        fig.suptitle("The agent with fake ranks speaking the store protocol (one failure each)")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
    if args.write:
        body = "\n".join([START, "## Coordination at scale (fake ranks)", "",
                          f"`python benchmarks/bench_coordination.py --ranks {' '.join(map(str, args.ranks))} --steps "
                          f"{args.steps}" + (f" --plot {args.plot}" if args.plot else "") + f"`, on {platform.node()}.",
                          "", *table, "", "" if not args.plot else f"![coordination]({args.plot.name})", END])
        write_section(args.write, body, START, END)


if __name__ == "__main__":
    sys.exit(main())
