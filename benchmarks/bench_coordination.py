"""Coordination at scale: the agent's per-step commit and its recovery protocol with thousands of ranks.

    python benchmarks/bench_coordination.py [--ranks 64 512 4096] [--steps 20] [--write docs/benchmarks.md]
        [--plot docs/coordination.png]

We cannot start thousands of training processes here, but the coordination does not need them: the real
:class:`~megatron_odyssey.runtime.agent.Agent` (its detection, commit, planning and recovery code, unchanged)
supervises *fake ranks*, threads that speak the real store protocol over their own TCPStore clients:
publish *ready*, block on *commit*, delete their key; on an abort register for recovery, block on the next
plan, join, block on *go*. They live in 8 *fake machines* (processes), each reporting its ranks' exits
as ``odyssey-launch``'s node agents do and sending their heartbeats (with progress) in one multi_set every
0.2 s. One fake rank dies mid-run (its exit reported as -9, as a SIGKILL's).

Measured, per rank count:
- *commit*: the agent's own time to commit a step once the last *ready* is in (``Agent.advance``: the
  ready counter, one ``check`` and one ``multi_get`` over every rank's key, the commit, the deletions),
  median over the steps. The wall time per step is shown too: it also counts the fake ranks' own store
  calls, which on a real cluster run on thousands of hosts in parallel but here share one Python process;
- *recovery*: detection to abort, abort to sealed membership, to the plan published (includes planning),
  to the new generation's *go* (every survivor joined), from the failure record's phases.
Goal (issue): commit under 10 ms per step and recovery coordination under 2 s at 4096 ranks.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from docs_section import write_section
from megatron_odyssey.launch import RemoteExits, RemoteRank, report_exit
from megatron_odyssey.planning.plan import ExecutionPlan
from megatron_odyssey.runtime.agent import Agent
from megatron_odyssey.runtime.plan_message import decode_plan_message
from megatron_odyssey.runtime.config import TrainConfig
from megatron_odyssey.runtime.errors import ABORTED, STARTED_KEY
from megatron_odyssey.runtime.liveness import Progress, WAITING

START, END = "<!-- bench_coordination:start -->", "<!-- bench_coordination:end -->"


class FakeRank(threading.Thread):
    """One rank's side of the protocol, without a model (``generation.GenerationRank`` minus the work)."""

    def __init__(self, rank_id: int, port: int, steps: int, kill_at: int | None):
        super().__init__(daemon=True)
        self.rank_id, self.steps, self.kill_at, self.port = rank_id, steps, kill_at, port
        self.store = None
        self.progress = Progress()
        self.gen, self.code = 0, None

    def run(self) -> None:
        # connected here, in the rank's own thread: thousands of clients connect in parallel, as on a cluster
        self.store = dist.TCPStore("127.0.0.1", self.port, is_master=False, timeout=timedelta(seconds=600))
        try:
            self._run()
            self.code = 0 if self.code is None else self.code
        except Exception as exc:  # noqa: BLE001 - reported as this rank's exit
            print(f"fake rank {self.rank_id}: {type(exc).__name__}: {exc}", file=sys.stderr)
            self.code = 1
        report_exit(self.store, self.rank_id, self.code)

    def _run(self) -> None:
        self.store.set(STARTED_KEY.format(self.rank_id), "1")  # past start-up: a failure is recovered from
        step = 0
        while step < self.steps:
            if self.kill_at == step:
                self.code = -9  # as SIGKILL-ed
                return
            g = f"odyssey/gen{self.gen}"
            self.progress.mark(step, "forward")
            self.store.append(f"{g}/ready/{step}/shares", f"{self.rank_id}=0.0;")
            self.store.add(f"{g}/ready/{step}/count", 1)
            self.progress.set_state(WAITING)
            self.store.wait([f"{g}/commit/{step}"])
            if self.store.get(f"{g}/commit/{step}") != ABORTED:
                step += 1
                continue
            # aborted: register, wait for the next plan, join, wait for go
            self.store.set(f"{g}/recover/{self.rank_id}", str(step - 1))
            nxt = f"odyssey/gen{self.gen + 1}"
            self.store.wait([f"{nxt}/plan"])
            msg = decode_plan_message(self.store.get(f"{nxt}/plan"))
            if self.rank_id not in ExecutionPlan.from_dict(msg["plan"]).live_nodes():  # as GenerationRank.enter
                return
            self.gen += 1
            self.store.set(f"{nxt}/join/{self.rank_id}", "1")
            self.store.wait([f"{nxt}/go"])
            step = int(msg["resume_step"])


def machine(port: int, ranks: list[int], steps: int, victim: int) -> None:
    """One fake machine (a process): its ranks as threads, and one heartbeat thread for all of them."""
    fakes = [FakeRank(i, port, steps, steps // 2 if i == victim else None) for i in ranks]
    beats = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
    for fake in fakes:
        fake.start()
    while any(f.is_alive() for f in fakes):
        alive = [f for f in fakes if f.code is None and f.store is not None]
        if alive:
            beats.multi_set([f"odyssey/hb/{f.rank_id}" for f in alive], [f.progress.beat() for f in alive])
        time.sleep(0.2)


def measure(n: int, steps: int, machines: int = 8, pp: int = 4) -> dict:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
    dp = n // pp
    cfg = TrainConfig(nproc=n, pp=pp, layers=32, hidden=64, heads=4, seq=32, global_batch=2 * dp, micro_batch=1,
                      steps=steps, checkpoint_interval=0, heartbeat_timeout_s=120.0, timeout_s=600.0,
                      soft_timeout_s=200.0, hard_timeout_s=400.0, extra={"max_cached_failures": 0})
    victim = n // 2 + 1
    ctx = mp.get_context("spawn")
    share = -(-n // machines)
    procs = [ctx.Process(target=machine, args=(store.port, list(range(m * share, min(n, (m + 1) * share))), steps,
                                               victim), daemon=True) for m in range(machines) if m * share < n]
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

    def timed_advance() -> None:
        before, t0, c0 = agent.next_step, time.perf_counter(), time.thread_time()
        advance()
        if agent.next_step != before:
            commits.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)

    agent.advance = timed_advance
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # the agent's per-step lines
        code = agent.supervise()
    wall = time.perf_counter() - t0
    for p in procs:
        p.join(30)
    steps_done = agent.steps.records()
    (failure,) = agent.failures
    phases = failure.phases
    return {"ranks": n, "code": code, "steps": len(steps_done), "wall_s": wall,
            "commit_ms": statistics.median(commits) * 1e3, "commit_p90_ms": sorted(commits)[int(0.9 * len(commits))] * 1e3,
            "commit_cpu_ms": statistics.median(cpu) * 1e3,
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
    table = ["| ranks | commit (agent), median | p90 | agent CPU per commit | wall per step (incl. fake ranks) | "
             "abort -> sealed | -> plan published (planning) | -> go | store keys at the end |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    table += [f"| {r['ranks']:,} | {r['commit_ms']:.2f} ms | {r['commit_p90_ms']:.2f} ms | {r['commit_cpu_ms']:.2f} ms | "
              f"{r['step_wall_ms']:.0f} ms | "
              f"{r['sealed_s']:.3f} s | {r['published_s']:.3f} s ({r['decision_s'] * 1e3:.0f} ms) | {r['go_s']:.3f} s | "
              f"{r['store_keys']} |" for r in rows]
    print("\n".join(table))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
        xs = [r["ranks"] for r in rows]
        a.plot(xs, [r["commit_ms"] for r in rows], "o-", label="agent's commit (median)")
        a.plot(xs, [r["commit_cpu_ms"] for r in rows], "s--", label="agent's CPU per commit (median)")
        a.axhline(10, color="grey", ls="--", label="goal 10 ms")
        a.set(xscale="log", xlabel="ranks", ylabel="ms per step", title="Per-step commit")
        a.legend()
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
