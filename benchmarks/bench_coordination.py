"""Coordination at scale: the agent's per-step commit and its recovery protocol with thousands of ranks.

    python benchmarks/bench_coordination.py [--ranks 64 512 4096] [--steps 20] [--write docs/benchmarks.md]
        [--plot docs/coordination.png]

We cannot start thousands of training processes here, but the coordination does not need them: the real
:class:`~megatron_odyssey.runtime.agent.Agent` (its detection, commit, planning and recovery code, unchanged)
supervises *fake ranks*, threads that speak the real store protocol over their own TCPStore clients:
publish *ready*, block on *commit*, delete their key; on an abort register for recovery, block on the next
plan, join, block on *go*. Heartbeats (with progress) come from one thread per 256 ranks, one multi_set
each. One fake rank is SIGKILL-ed (its thread stops and its exit code becomes -9) mid-run.

Measured, per rank count:
- *commit*: the agent's own time to commit a step once the last *ready* is in (``Agent.advance``: one
  ``check`` and one ``multi_get`` over every rank's key, the commit, the deletion of the previous one),
  median over the steps. The wall time per step is shown too: it also counts the fake ranks' own store
  calls, which on a real cluster run on thousands of hosts in parallel but here share one Python process;
- *recovery*: detection to abort, abort to sealed membership, to the plan published (includes planning),
  to the new generation's *go* (every survivor joined), from the failure record's phases.
Goal (issue): commit under 10 ms per step and recovery coordination under 2 s at 4096 ranks.
"""
from __future__ import annotations

import argparse
import json
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
from megatron_odyssey.runtime.agent import Agent
from megatron_odyssey.runtime.config import TrainConfig
from megatron_odyssey.runtime.errors import ABORTED
from megatron_odyssey.runtime.liveness import Progress, WAITING

START, END = "<!-- bench_coordination:start -->", "<!-- bench_coordination:end -->"


class FakeRank(threading.Thread):
    """One rank's side of the protocol, without a model (``generation.GenerationRank`` minus the work)."""

    def __init__(self, ident: int, port: int, steps: int, kill_at: int | None):
        super().__init__(daemon=True)
        self.ident, self.steps, self.kill_at = ident, steps, kill_at
        self.store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
        self.exitcode: int | None = None
        self.progress = Progress()
        self.gen, self.killed = 0, threading.Event()

    # the agent's view of a process
    @property
    def pid(self) -> None:
        return None

    def kill(self) -> None:
        self.killed.set()
        if self.exitcode is None:
            self.exitcode = -9

    def join(self, timeout: float | None = None) -> None:  # noqa: D401 - a process's join
        pass

    def run(self) -> None:
        try:
            self._run()
            if self.exitcode is None:
                self.exitcode = 0
        except Exception as exc:  # noqa: BLE001 - a dead store at the end of the benchmark
            if self.exitcode is None:
                self.exitcode = 1 if not self.killed.is_set() else -9
                if not self.killed.is_set():
                    print(f"fake rank {self.ident}: {type(exc).__name__}: {exc}", file=sys.stderr)

    def _run(self) -> None:
        step = 0
        while step < self.steps:
            if self.kill_at == step:
                self.kill()
                return
            g = f"odyssey/gen{self.gen}"
            self.progress.mark(step, "forward")
            self.store.set(f"{g}/ready/{step}/{self.ident}", "0.0")
            self.progress.set_state(WAITING)
            self.store.wait([f"{g}/commit/{step}"])
            if self.store.get(f"{g}/commit/{step}") != ABORTED:
                self.store.delete_key(f"{g}/ready/{step}/{self.ident}")
                step += 1
                continue
            # aborted: register, wait for the next plan, join, wait for go
            self.store.set(f"{g}/recover/{self.ident}", str(step - 1))
            nxt = f"odyssey/gen{self.gen + 1}"
            self.store.wait([f"{nxt}/plan"])
            msg = json.loads(self.store.get(f"{nxt}/plan"))
            live = {s["node"] for p in msg["plan"]["pipelines"] for s in p["stages"]} - set(msg["plan"].get("failed", []))
            if self.ident not in live:
                return
            self.gen += 1
            self.store.set(f"{nxt}/join/{self.ident}", "1")
            self.store.wait([f"{nxt}/go"])
            step = int(msg["resume_step"])


def heartbeats(port: int, ranks: list[FakeRank], stop: threading.Event) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    while not stop.is_set():
        alive = [r for r in ranks if r.exitcode is None]
        if alive:
            store.multi_set([f"odyssey/hb/{r.ident}" for r in alive], [r.progress.beat() for r in alive])
        stop.wait(0.2)


def measure(n: int, steps: int, pp: int = 4) -> dict:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    dp = n // pp
    cfg = TrainConfig(nproc=n, pp=pp, layers=32, hidden=64, heads=4, seq=32, global_batch=2 * dp, micro_batch=1,
                      steps=steps, checkpoint_interval=0, heartbeat_timeout_s=60.0, timeout_s=300.0,
                      soft_timeout_s=100.0, hard_timeout_s=200.0, extra={"max_cached_failures": 0})
    victim = n // 2 + 1
    ranks = [FakeRank(i, store.port, steps, steps // 2 if i == victim else None) for i in range(n)]
    work = Path(tempfile.mkdtemp(prefix="odyssey-coordination-"))
    agent = Agent(cfg, None, work, echo_rank0=False, procs={r.ident: r for r in ranks}, store=store)
    agent.log = lambda msg: None  # the candidates' table per failure is not what we measure
    commits: list[float] = []
    advance = agent.advance

    def timed_advance() -> None:
        before, t0 = agent.next_step, time.perf_counter()
        advance()
        if agent.next_step != before:
            commits.append(time.perf_counter() - t0)

    agent.advance = timed_advance
    stop = threading.Event()
    beat_threads = [threading.Thread(target=heartbeats, args=(store.port, ranks[i:i + 256], stop), daemon=True)
                    for i in range(0, n, 256)]
    for t in (*beat_threads, *ranks):
        t.start()
    t0 = time.perf_counter()
    code = agent.supervise()
    wall = time.perf_counter() - t0
    stop.set()
    steps_done = agent.steps.records()
    (failure,) = agent.failures
    phases = failure.phases
    return {"ranks": n, "code": code, "steps": len(steps_done), "wall_s": wall,
            "commit_ms": statistics.median(commits) * 1e3, "commit_p90_ms": sorted(commits)[int(0.9 * len(commits))] * 1e3,
            "step_wall_ms": statistics.median(s["time_s"] for s in steps_done[1:]) * 1e3,
            "detection_s": failure.detection_s, "sealed_s": phases["sealed_s"], "published_s": phases["published_s"],
            "decision_s": failure.decision_s, "go_s": phases.get("joined_s") or float("nan"),
            "store_keys": steps_done[-1]["store_keys"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[64, 512, 4096])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--write", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args(argv)
    rows = []
    for n in args.ranks:
        r = measure(n, args.steps)
        rows.append(r)
        print(json.dumps(r), flush=True)
    table = ["| ranks | commit (agent), median | p90 | wall per step (incl. fake ranks) | abort -> sealed | "
             "-> plan published (planning) | -> go | store keys at the end |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    table += [f"| {r['ranks']:,} | {r['commit_ms']:.2f} ms | {r['commit_p90_ms']:.2f} ms | {r['step_wall_ms']:.0f} ms | "
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
    return 0 if all(r["code"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
