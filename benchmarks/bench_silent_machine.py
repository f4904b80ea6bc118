"""How long a request to a machine that went silent (lost power or its network) takes to fail, with our control-store
client (``control_plane.client``: ``TCP_USER_TIMEOUT`` and keepalive, ``runtime/sockets.py``) and with a plain
``torch.distributed.TCPStore`` client.

    sudo python benchmarks/bench_silent_machine.py [--rounds 5] [--cap 60] [--plot docs/silent_machine.png]

Each round starts a store in a network namespace (``testing.network_namespace``; needs root), connects three
clients from here: ours waiting in ``get`` for a key never set (a rank waiting for a commit), ours polling with
``check`` (a launcher), and a plain client polling with ``check``; then cuts the namespace's link and times each
request's failure, giving up on one after ``--cap`` seconds. Medians on stdout, progress on stderr (tqdm).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

SERVE = ("import sys, time, torch.distributed as d; s = d.TCPStore('0.0.0.0', int(sys.argv[1]), is_master=True, "
         "wait_for_workers=False); s.set('k', '1'); print('up', flush=True); time.sleep(3600)")
PLAIN = ("import sys, torch.distributed as d; from datetime import timedelta; s = d.TCPStore(sys.argv[1], "
         "int(sys.argv[2]), is_master=False, timeout=timedelta(seconds=3600)); print('up', flush=True); "
         "sys.stdin.readline()\ntry:\n s.check(['k'])\nexcept Exception:\n print('failed', flush=True)")
CLIENTS = ("ours, waiting in get", "ours, polling with check", "plain TCPStore, check")


def plain_failed(plain) -> None:
    """Raises once the plain client's process says its request failed (returns when it is killed first)."""
    if plain.stdout.readline() == "failed\n":
        raise ConnectionError("the plain client's request failed")


def one_round(cap_s: float) -> list[float]:
    """Seconds from the cut to each client's failure (``cap_s`` where it had not failed by then)."""
    import subprocess

    from megatron_odyssey.runtime.control_plane import client
    from megatron_odyssey.testing.network_namespace import network_namespace

    with network_namespace() as space:
        server = space.popen([sys.executable, "-c", SERVE, "29911"], stdout=subprocess.PIPE)
        assert server.stdout.readline() == b"up\n"
        address = (space.ip, 29911)
        waiting, polling = client(address, 3600), client(address, 3600)
        plain = subprocess.Popen([sys.executable, "-c", PLAIN, *map(str, address)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)  # (its own process: ours bind every
        assert plain.stdout.readline() == "up\n"  # connection of their process to that store)
        ended: dict[int, float] = {}

        def failing(index: int, request) -> threading.Thread:
            def run() -> None:
                try:
                    request()
                except Exception:  # noqa: BLE001
                    ended[index] = time.monotonic()

            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            return thread

        failing(0, lambda: waiting.get("never"))
        time.sleep(0.5)
        space.cut()
        cut = time.monotonic()
        plain.stdin.write("ask\n")
        plain.stdin.flush()
        failing(1, lambda: polling.check(["k"]))
        failing(2, lambda: plain_failed(plain))
        while len(ended) < 3 and time.monotonic() - cut < cap_s:
            time.sleep(0.05)
        plain.kill()
        server.kill()
        return [min(ended[i] - cut, cap_s) if i in ended else cap_s for i in range(3)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cap", type=float, default=60.0, help="give up on a request after this many seconds")
    parser.add_argument("--plot", type=Path, default=None, help="write a bar chart of the medians here")
    args = parser.parse_args()
    from tqdm import tqdm

    rounds = [one_round(args.cap) for _ in tqdm(range(args.rounds), desc="rounds", file=sys.stderr)]
    medians = [statistics.median(r[i] for r in rounds) for i in range(3)]
    for name, median, each in zip(CLIENTS, medians, zip(*rounds)):
        capped = sum(1 for t in each if t >= args.cap)
        print(f"{name:28s} median {median:6.2f} s  rounds {', '.join(f'{t:.2f}' for t in each)}"
              + (f"  ({capped} of {len(each)} still waiting at the {args.cap:g}-s cap)" if capped else ""))
    print(f"plain / ours (polling): >= {medians[2] / medians[1]:.1f}x")
    if args.plot is not None:
        plot(medians, args.cap, args.rounds, args.plot)
        print(f"wrote {args.plot}")


def plot(medians: list[float], cap_s: float, rounds: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.2))
    bars = ax.barh(CLIENTS[::-1], medians[::-1], color=["#999999", "#2a7ab0", "#2a7ab0"])
    for bar, median in zip(bars, medians[::-1]):
        label = f">= {median:.0f} s (still waiting)" if median >= cap_s else f"{median:.1f} s"
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + label, va="center")
    ax.set_xlim(0, cap_s * 1.6)
    ax.set_xlabel(f"seconds from the cut to the request's failure (median of {rounds}; given up at {cap_s:g} s)")
    ax.set_title("A store request to a machine gone silent (its link cut)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)

if __name__ == "__main__":
    main()
