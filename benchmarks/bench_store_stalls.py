"""How long a control store's live clients wait while new clients connect (``runtime.control_plane.serve``).

    python benchmarks/bench_store_stalls.py [--clients 200] [--plot store_stalls.png]

For each server (c10d's own dual-stack listener, and ``serve``'s IPv4 one), a live client pings the store every 5 ms
while another thread makes ``--clients`` new clients one after the other, as ranks do when they start or follow a
takeover. Printed per server: the live client's median and worst wait, its waits over 1 s, and the new clients that
took over 1 s to connect (the client-side reverse lookup of the address, which ``serve`` does not change). Where
DNS drops a packet, a lookup costs the resolver's 5 s; the first column shows whether the server's own thread waited
for one, and every client with it. The plot shows each ping's wait over time.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def measure(kind: str, clients: int) -> dict:
    import torch.distributed as dist
    from datetime import timedelta

    from megatron_odyssey.runtime.control_plane import client, free_port, serve
    from megatron_odyssey.testing.store_pinger import Pinger

    port = free_port()
    server = (serve("127.0.0.1", port, 30) if kind == "serve" else
              dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)))
    pinger = Pinger(client(("127.0.0.1", port), 30)).start()
    from tqdm import tqdm

    connects = []
    for _ in tqdm(range(clients), desc=kind, file=sys.stderr):
        t = time.monotonic()
        try:
            fresh = client(("127.0.0.1", port), 30)
            del fresh
        except Exception:  # noqa: BLE001 - counted as a slow connect (it took its whole time)
            pass
        connects.append(time.monotonic() - t)
        time.sleep(0.02)
    waits = pinger.stop()
    del pinger, server
    only = [w for _, w in waits]
    return {"kind": kind, "waits": waits, "median_ms": 1e3 * statistics.median(only), "worst_s": max(only),
            "stalls": sum(w > 1.0 for w in only), "slow_connects": sum(c > 1.0 for c in connects)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=200, help="new clients per server (default 200)")
    parser.add_argument("--plot", type=Path, default=None, help="write the pings' waits over time here (PNG)")
    args = parser.parse_args()
    results = [measure(kind, args.clients) for kind in ("c10d", "serve")]
    print(f"{'server':8} {'median wait':>12} {'worst wait':>11} {'waits > 1 s':>12} {'connects > 1 s':>15}")
    for r in results:
        print(f"{r['kind']:8} {r['median_ms']:>9.2f} ms {r['worst_s']:>9.2f} s {r['stalls']:>12} "
              f"{r['slow_connects']:>11} / {args.clients}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(2, 1, figsize=(9, 5), sharex=True, sharey=True)
        for ax, r in zip(axes, results):
            ax.plot([t for t, _ in r["waits"]], [w for _, w in r["waits"]], ".", ms=4)
            title = "c10d's own listener (dual-stack IPv6)" if r["kind"] == "c10d" else "serve (IPv4 listener)"
            ax.set_title(f"{title}: worst wait {r['worst_s']:.2f} s", fontsize=10)
            ax.set_ylabel("live client's wait (s)")
        axes[-1].set_xlabel(f"seconds since the first of {args.clients} new clients")
        fig.suptitle("A live client's store operations while new clients connect", fontsize=11)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
