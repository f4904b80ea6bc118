"""What a slow resolver on the agent's machine costs the job's store, and what naming the ranks' machines in
/etc/hosts saves (``runtime.control_plane.serve``; the remedy ``Agent._check_names`` says).

    python benchmarks/bench_store_names.py [--clients 300] [--delay-ms 50] [--parallel 32] [--rounds 3]
                                           [--plot store_names.png]

Two machines behind a router (``testing.network_namespace.routed_machines``; needs root and iproute2): the store's
(machine 0, served by ``serve`` as the agent's is) and the ranks' (machine 1). Machine 0's resolver is a name server
on machine 0 that answers every query ``--delay-ms`` late with "no such name" (``testing.slow_dns``). From machine 1,
a live client pings the store every 5 ms (a rank's heartbeat) while ``--clients`` new clients connect, ``--parallel``
at a time (ranks starting together, three clients each, and holding them). Two cases: machine 0's /etc/hosts names
machine 1, or it does not (every name goes to the slow resolver). Printed per case, from the round whose time until
all were connected is the median of ``--rounds``: the new clients' median connect time, the time until all were
connected, the live client's median and worst wait while they connected, and the name server's queries per new
client. The plot shows that round's live client's waits over time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

CLIENTS = r"""
import json, sys, time
from concurrent.futures import ThreadPoolExecutor
from megatron_odyssey.runtime.control_plane import client
from megatron_odyssey.testing.store_pinger import Pinger
address, count, parallel = (sys.argv[1], int(sys.argv[2])), int(sys.argv[3]), int(sys.argv[4])
pinger, connects = Pinger(client(address, 60)).start(), []
time.sleep(0.5)
def connect(_):
    t = time.monotonic()
    fresh = client(address, 60)
    connects.append(time.monotonic() - t)
    return fresh
burst_from = pinger.since_start()
with ThreadPoolExecutor(parallel) as pool:
    held = list(pool.map(connect, range(count)))  # (held: ranks keep theirs)
burst = pinger.since_start() - burst_from
time.sleep(0.5)
print(json.dumps({"waits": pinger.stop(), "connects": connects, "burst": burst, "burst_from": burst_from}))
"""

SERVER = r"""
import sys, time
from megatron_odyssey.runtime.control_plane import serve
store = serve("0.0.0.0", int(sys.argv[1]), 60)
print("up", flush=True)
time.sleep(3600)
"""


def _started(proc: subprocess.Popen, what: str) -> None:
    line = proc.stdout.readline().strip()
    if line != "up":
        proc.kill()
        raise SystemExit(f"{what} did not start: {line!r}")


def measure(machines, named: bool, clients: int, delay_ms: float, parallel: int) -> dict:
    from megatron_odyssey.runtime.control_plane import free_port
    from megatron_odyssey.testing.slow_dns import slow_names

    store_machine, ranks_machine = machines.machines
    port = free_port()
    with slow_names(store_machine, delay_ms / 1e3, (ranks_machine.ip,) if named else ()) as names:
        server = store_machine.popen([sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE, text=True)
        try:
            _started(server, "the store")
            t = time.monotonic()
            done = ranks_machine.popen([sys.executable, "-c", CLIENTS, store_machine.ip, str(port), str(clients),
                                        str(parallel)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            out, err = done.communicate(timeout=clients * 30 + 120)
            wall = time.monotonic() - t
            if done.returncode != 0:
                raise SystemExit(f"the clients failed: {err[-2000:]}")
            result = json.loads(out)
        finally:
            server.kill()
            queries = len(names.stop())
    start, end = result["burst_from"], result["burst_from"] + result["burst"]
    waits = [w for t, w in result["waits"] if start <= t <= end] or [0.0]  # (while the new clients connect)
    return {"case": "/etc/hosts names the ranks' machine" if named else f"resolver {delay_ms:g} ms late",
            "named": named, "waits": result["waits"], "connects": result["connects"],
            "connect_median_ms": 1e3 * statistics.median(result["connects"]),
            "all_connects_s": result["burst"], "wall_s": wall,
            "wait_median_ms": 1e3 * statistics.median(waits), "wait_worst_ms": 1e3 * max(waits),
            "queries_per_client": queries / (clients + 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=300, help="new clients (default 300)")
    parser.add_argument("--delay-ms", type=float, default=50.0, help="how late the resolver answers (default 50)")
    parser.add_argument("--parallel", type=int, default=32, help="clients connecting at once (default 32)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per case; the median round is shown (default 3)")
    parser.add_argument("--plot", type=Path, default=None, help="write the live client's waits here (PNG)")
    args = parser.parse_args()
    from tqdm import tqdm

    from megatron_odyssey.testing.network_namespace import routed_machines

    results = []
    with routed_machines(2) as machines:
        for named in (True, False):
            rounds = [measure(machines, named, args.clients, args.delay_ms, args.parallel)
                      for _ in tqdm(range(args.rounds), desc="named" if named else "resolver", file=sys.stderr)]
            middle = sorted(rounds, key=lambda r: r["all_connects_s"])[len(rounds) // 2]  # (its waits are plotted)
            middle["all_rounds_s"] = [r["all_connects_s"] for r in rounds]
            results.append(middle)
    print(f"{'case':38} {'connect (median)':>17} {'all connected':>14} {'wait (median)':>14} {'wait (worst)':>13} "
          f"{'queries / client':>17}")
    for r in results:
        queries = f"{r['queries_per_client']:.2f}"
        print(f"{r['case']:38} {r['connect_median_ms']:>14.1f} ms {r['all_connects_s']:>12.2f} s "
              f"{r['wait_median_ms']:>11.2f} ms {r['wait_worst_ms']:>10.1f} ms {queries:>17}")
    fast, slow = results
    for r in results:
        print(f"{r['case']}: all connected after {', '.join(f'{t:.2f}' for t in r['all_rounds_s'])} s")
    print(f"{args.clients} new clients, {args.parallel} at a time (median of {args.rounds} rounds): "
          f"{slow['all_connects_s'] / fast['all_connects_s']:.1f}x the time until all connected "
          f"with a resolver {args.delay_ms:g} ms late ({slow['all_connects_s']:.2f} s against "
          f"{fast['all_connects_s']:.2f} s)")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(2, 1, figsize=(9, 5), sharex=True, sharey=True)
        for ax, r in zip(axes, results):
            ax.plot([t for t, _ in r["waits"]], [1e3 * w for _, w in r["waits"]], ".", ms=3)
            ax.set_title(f"{r['case']}: {args.clients} clients ({args.parallel} at a time) connected in "
                         f"{r['all_connects_s']:.1f} s; "
                         f"live client's worst wait {r['wait_worst_ms']:.0f} ms", fontsize=10)
            ax.set_ylabel("live client's wait (ms)")
        axes[-1].set_xlabel("seconds since the live client connected")
        fig.suptitle("A store's live client while new clients connect, by how the store's machine names them",
                     fontsize=11)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
