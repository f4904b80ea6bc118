"""Why the diagnosis does not judge a node that slept between its operations: on the CPU, the same operation
right after the thread slept reads several times its CPU time (cold caches, a core clocked down or handed to
another guest), so the ends of a slow link (the sender holds each message back, the receiver waits for it)
would read "slow" beside their twins.

    python benchmarks/bench_cold_after_sleep.py [--rounds 60] [--write docs/benchmarks.md]
        [--plot docs/cold_after_sleep.png]

One operation = forward and backward of the demo-sized MLP block (4 x Linear(64, 64), 8 rows) on one thread, as
a tiny-model rank computes it; timed by ``op_trace.compute_clock("cpu")`` (the thread's CPU time: what the
diagnosis compares). Per sleep length before each operation, the median over ``--rounds`` operations; the
lengths are interleaved round by round so load changes hit every one alike. The ratio is to no sleep.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from docs_section import write_section
from megatron_odyssey.runtime.op_trace import compute_clock

SLEEPS_S = (0.0, 0.001, 0.01, 0.03, 0.1)
MARKERS = ("<!-- cold-after-sleep:start -->", "<!-- cold-after-sleep:end -->")


def measure(rounds: int) -> dict[float, list[float]]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    block = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    x = torch.randn(8, 64)
    clock = compute_clock("cpu")

    def operation() -> float:
        t = clock()
        block(x).sum().backward()
        return clock() - t

    for _ in range(50):  # warm-up: allocator, autograd's first graph
        operation()
    times: dict[float, list[float]] = {s: [] for s in SLEEPS_S}
    for _ in range(rounds):
        for s in SLEEPS_S:
            operation()  # warm again after the previous length's sleep
            if s:
                time.sleep(s)
            times[s].append(operation())
    return times


def render(times: dict[float, list[float]], command: str) -> str:
    base = statistics.median(times[0.0])
    rows = [f"| {s * 1e3:g} | {statistics.median(t) * 1e6:.0f} | {min(t) * 1e6:.0f} | "
            f"{statistics.median(t) / base:.2f}x |" for s, t in times.items()]
    return "\n".join([
        MARKERS[0], "", "## The CPU time of an operation after sleeping", "",
        f"`{command}` on {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, one thread; "
        f"{len(times[0.0])} operations per sleep length (the median and the shortest).", "",
        "| sleep before (ms) | CPU time median (us) | shortest (us) | median over no sleep |",
        "|---:|---:|---:|---:|", *rows, "",
        "Why `diagnosis.Diagnoser.idled` leaves out, for a step, a node that slept between its operations, per second of "
        "compute, 3x as long as its twins (and 2 ms more per operation).", "", "![CPU time after sleeping](cold_after_sleep.png)", "",
        MARKERS[1]])


def plot(times: dict[float, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = statistics.median(times[0.0])
    labels = [f"{s * 1e3:g} ms" for s in times]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.boxplot([[t / base for t in v] for v in times.values()], showfliers=False)
    ax.set_xticks(range(1, len(labels) + 1), labels)
    ax.axhline(2.0, color="tab:red", linestyle="--", linewidth=1, label="diagnosis' slow threshold (2x)")
    ax.set_xlabel("sleep before the operation")
    ax.set_ylabel("CPU time / median without sleep")
    ax.set_title("One operation's thread CPU time after the thread slept")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--write", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    times = measure(args.rounds)
    text = render(times, "python " + " ".join(sys.argv))
    print(text)
    if args.write:
        write_section(args.write, text, *MARKERS)
    if args.plot:
        plot(times, args.plot)


if __name__ == "__main__":
    main()
