"""How long one round of ``runtime.reachability`` takes, and how many connections it opens, when ranks are asked one
per machine (now) against every rank asked (before), with part of the machines gone silent to the others.

    python benchmarks/bench_reach_round.py [--jobs 8x4:2,16x8:4,32x8:8] [--rounds 3] [--plot reach_round.png]

Each job is MACHINESxRANKS:SILENT: that many machines of that many ranks each, on this machine's loopback
(machine m at 127.0.0.m+1, which every rank's listener takes), the last SILENT of them answering no connection
(``testing.network_namespace.silent_address``: their SYNs are dropped, as to a rack behind a failed switch port),
though their ranks still reach the others. Every rank runs its real ``Prober`` ticking in a heartbeat thread of its
own on a real store; the agent's side writes the ask and waits for every answer, as ``Agent._reach_round`` does.
Printed per job and way of asking: the round's median wall time, the connections opened, and the ranks that the
answers cut (both ways must cut the same ranks). Every rank's probes run on this one machine, so the time of a round
in which every rank is asked is mostly this machine's CPU; on a cluster each machine probes from its own, and what
stays is the wait for unreached peers: a probe's timeout per ``PROBE_THREADS`` of them, ranks before, machines now.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path


def parse_jobs(text: str) -> list[tuple[int, int, int]]:
    jobs = []
    for item in text.split(","):
        shape, _, silent = item.partition(":")
        machines, _, ranks = shape.partition("x")
        jobs.append((int(machines), int(ranks), int(silent or 0)))
        if not 0 <= jobs[-1][2] < jobs[-1][0]:
            raise SystemExit(f"--jobs {item}: SILENT must be fewer than the machines")
    return jobs


def run_job(machines: int, per_machine: int, silent: int, rounds: int) -> list[dict]:
    import torch.distributed as dist

    from megatron_odyssey.runtime import reachability
    from megatron_odyssey.runtime.control_plane import free_port, serve
    from megatron_odyssey.testing.network_namespace import silent_address

    port = free_port()
    store = serve("127.0.0.1", port, 60)
    n = machines * per_machine
    probers = [reachability.Prober(i, "127.0.0.1", port) for i in range(n)]
    stop = threading.Event()
    results = []
    with ExitStack() as stack:
        for m in range(machines):
            group = probers[m * per_machine:(m + 1) * per_machine]
            address = stack.enter_context(silent_address(f"127.0.0.{m + 1}")) if m >= machines - silent else None
            for p in group:
                p.address = address or f"127.0.0.{m + 1}:{p.listener.port}"

        def beat(prober: reachability.Prober) -> None:  # as a rank's heartbeat thread
            client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
            while not stop.is_set():
                prober.tick(client)
                stop.wait(0.05)

        threads = [threading.Thread(target=beat, args=(p,), daemon=True) for p in probers]
        for t in threads:
            t.start()
        time.sleep(1.0)
        address = {p.ident: p.address for p in probers}
        members = reachability.machines(address)
        asked_by = {"ranks": {i: [i] for i in range(n)}, "machines": members}  # (who speaks for which ranks)
        for way, groups in asked_by.items():
            asked = sorted(groups)
            listeners = [[i, [address[r] for r in groups[i]]] for i in asked]
            times, cut = [], None
            for r in range(rounds):
                round_id = f"{way}-{r}"
                keys = [reachability.ANSWER_KEY.format(round_id, i) for i in asked]
                t0 = time.monotonic()
                store.set(reachability.ASK_KEY, json.dumps({"round": round_id, "ranks": asked,
                                                                "machines": listeners}))
                while not store.check(keys):
                    time.sleep(0.01)
                times.append(time.monotonic() - t0)
                reach = {i: set(json.loads(store.get(k))) for i, k in zip(asked, keys)}
                if way == "ranks":  # (a rank reaches a peer's machine, or not: by rank as before)
                    keep = reachability.kept(reach)
                else:
                    keep = [r for m in reachability.kept(reach, members) for r in members[m]]
                cut = sorted(set(range(n)) - set(keep))
            results.append({"job": f"{machines}x{per_machine}:{silent}", "ranks": n, "way": way,
                            "median_s": statistics.median(times), "times": times,
                            "connections": len(asked) * (len(asked) - 1), "cut": cut})
            print(f"  {results[-1]['job']:>9} {way:>8}: median {results[-1]['median_s']:.2f} s, "
                  f"{results[-1]['connections']} connections, cut {len(cut)} ranks", file=sys.stderr)
        stop.set()
        for t in threads:
            t.join(5)
    for p in probers:
        p.listener.close()
    del store
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", default="8x4:2,16x8:4,32x8:8", help="MACHINESxRANKS:SILENT, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per job and way of asking (default 3)")
    parser.add_argument("--plot", type=Path, default=None, help="write the rounds' times and connections here (PNG)")
    args = parser.parse_args()
    from tqdm import tqdm

    results = []
    for job in tqdm(parse_jobs(args.jobs), desc="jobs", file=sys.stderr):
        results += run_job(*job, args.rounds)
    print(f"{'job':>10} {'ranks':>6} {'asked':>9} {'median round':>13} {'connections':>12} {'ranks cut':>10}")
    for r in results:
        print(f"{r['job']:>10} {r['ranks']:>6} {r['way']:>9} {r['median_s']:>11.2f} s {r['connections']:>12} "
              f"{len(r['cut']):>10}")
    by_job: dict[str, dict[str, dict]] = {}
    for r in results:
        by_job.setdefault(r["job"], {})[r["way"]] = r
    for job, ways in by_job.items():
        same = ways["ranks"]["cut"] == ways["machines"]["cut"]
        print(f"{job}: one per machine / every rank: {ways['machines']['median_s'] / ways['ranks']['median_s']:.2f}x "
              f"the time, {ways['machines']['connections'] / ways['ranks']['connections']:.3f}x the connections; "
              f"same ranks cut: {same}")
        if not same:
            raise SystemExit(f"{job}: the two ways cut different ranks: {ways['ranks']['cut']} against "
                             f"{ways['machines']['cut']}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        jobs = list(by_job)
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        width = 0.38
        for k, (way, label) in enumerate((("ranks", "every rank asked (before)"),
                                          ("machines", "one rank per machine (now)"))):
            xs = [i + (k - 0.5) * width for i in range(len(jobs))]
            left.bar(xs, [by_job[j][way]["median_s"] for j in jobs], width, label=label)
            right.bar(xs, [by_job[j][way]["connections"] for j in jobs], width, label=label)
        for ax, title in ((left, "median time of a round (s): every rank's probes on this one machine"),
                          (right, "connections opened per round")):
            ax.set_xticks(range(len(jobs)), [f"{j}\n({by_job[j]['ranks']['ranks']} ranks)" for j in jobs])
            ax.set_xlabel("machines x ranks per machine : machines gone silent")
            ax.set_title(title, fontsize=10)
        right.set_yscale("log")
        left.legend(fontsize=8)
        fig.suptitle("Who reaches whom: one round, part of the machines silent to the others", fontsize=11)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
