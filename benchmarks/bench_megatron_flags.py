"""Production Megatron-LM flags with Odyssey, before and after a failure, side by side in one run.

    MEGATRON_LM_PATH=/path/to/Megatron-LM python benchmarks/bench_megatron_flags.py [--repeats 3] \
        [--write docs/benchmarks.md] [--plot docs/megatron_flags.png]

The tiny Llama-style GPT of the Megatron-LM tests on CPU ranks (gloo), 16 iterations, rank 1 SIGKILLed
in the backward pass of iteration 6 and the job forced to reroute. Variants, interleaved in every round:
the default DDP, ``--overlap-grad-reduce`` (4 ranks, PP=2 x DP=2), and the distributed optimizer in two
instances (``--use-distributed-optimizer --num-distributed-optimizer-instances 2``, 8 ranks, PP=2 x
DP=4), without and with both overlaps (``--overlap-grad-reduce --overlap-param-gather``; stock with
``--no-align-grad-reduce``, without which it reduces each step's gradients twice), each also run stock
(torchrun, no failure) as its reference. Reported per variant: Megatron's
per-iteration time before the failure (iterations 2-5), after the recovery (9-16) and stock's, the
recovery time, the largest share of its stage's optimizer state a survivor keeps after the recovery, and
whether every logged iteration equals stock's.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import textwrap
from pathlib import Path

from docs_section import write_section
from megatron_rounds import run_rounds
from megatron_odyssey.megatron_lm.cpu_mode import tiny_gpt_flags
from megatron_odyssey.testing.megatron_lm_job import run_odyssey, run_stock, same_training

START, END = "<!-- megatron-flags:start -->", "<!-- megatron-flags:end -->"
ITERS, FAIL_AT = 16, 6
DISTOPT = ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"]
VARIANTS = {  # name -> (extra flags, ranks, stock's own extra flags)
    "DDP": ([], 4, []),
    "--overlap-grad-reduce": (["--overlap-grad-reduce"], 4, []),
    "distributed optimizer, 2 instances": (DISTOPT, 8, []),
    "distributed optimizer, 2 instances, both overlaps": (
        [*DISTOPT, "--overlap-grad-reduce", "--overlap-param-gather"], 8, ["--no-align-grad-reduce"]),
}


def median_ms(ms: dict[int, float], first: int, last: int) -> float:
    return statistics.median(ms[i] for i in range(first, last + 1))


def one_round(mlm: str, work: Path, port: int) -> dict[str, dict]:
    out = {}
    for i, (name, (extra, nproc, stock_extra)) in enumerate(VARIANTS.items()):
        flags = [*tiny_gpt_flags(ITERS), *extra]
        stock = run_stock(mlm, work / f"stock{i}", [*flags, *stock_extra], port + 20 * i, nproc=nproc)
        assert stock.returncode == 0, stock.logs[-3000:]
        job = run_odyssey(mlm, work / f"ody{i}", [*flags, "--odyssey-heartbeat-timeout", "10", "--odyssey-policy",
                                                  "reroute", "--odyssey-inject-fault",
                                                  f"step={FAIL_AT},rank=1,phase=backward,kind=kill"],
                          port + 20 * i + 10, nproc=nproc)
        assert job.returncode == 0, job.logs[-3000:]
        (failure,) = job.report["failures"]
        ms = job.iteration_ms()
        stock_ms = stock.iteration_ms()
        out[name] = {"stock_before_ms": median_ms(stock_ms, 2, FAIL_AT - 1), "before_ms": median_ms(ms, 2, FAIL_AT - 1),
                     "stock_after_ms": median_ms(stock_ms, FAIL_AT + 3, ITERS),
                     "after_ms": median_ms(ms, FAIL_AT + 3, ITERS), "recovery_s": failure["recovery_s"],
                     "exact": same_training(job.iterations(), stock.iterations()), "ranks": nproc,
                     # each survivor's share of its stage's optimizer state after the recovery (1: all of it)
                     "optimizer_share": max(failure.get("optimizer_shares", {}).values(), default=1.0)}
    return out


def _after_ratio(rounds: list[dict[str, dict]], overlapped: str, plain: str) -> str:
    """After the recovery, a variant with overlap over the same without, on the same ranks."""
    with_overlap = statistics.median(r[overlapped]["after_ms"] for r in rounds)
    without = statistics.median(r[plain]["after_ms"] for r in rounds)
    return f"{with_overlap:.1f} ms with overlap against {without:.1f} ms without, ratio {with_overlap / without:.2f}"


def render(rounds: list[dict[str, dict]], command: str) -> str:
    def med(name: str, key: str) -> float:
        return statistics.median(r[name][key] for r in rounds)

    lines = [START, "## Production Megatron-LM flags through a failure (issue 13)", "", f"Command: `{command}`  ",
             f"Machine: `{platform.platform()}`, {os.cpu_count()} cores, Python {platform.python_version()}; "
             f"Megatron-LM core_r0.16.0 on CPU ranks (gloo), 4-layer hidden-64 Llama-style GPT, mock data, {ITERS} "
             f"iterations, rank 1 SIGKILLed in the backward pass of iteration {FAIL_AT}, forced reroute. Medians of "
             f"{len(rounds)} rounds, variants interleaved in each round; per-iteration times from Megatron's own log.",
             "", f"| variant | ranks | iterations 2-{FAIL_AT - 1}: stock (ms) | Odyssey (ms) | ratio | iterations "
             f"{FAIL_AT + 3}-{ITERS}: stock, all ranks (ms) | Odyssey, one rank fewer (ms) | ratio | recovery (s) | "
             "optimizer state kept per rank after it | equal to stock |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in VARIANTS:
        before, after = med(name, "before_ms"), med(name, "after_ms")
        s_before, s_after = med(name, "stock_before_ms"), med(name, "stock_after_ms")
        exact = all(r[name]["exact"] for r in rounds)
        lines.append(f"| {name} | {rounds[0][name]['ranks']} | {s_before:.1f} | {before:.1f} | {before / s_before:.2f} | "
                     f"{s_after:.1f} | {after:.1f} | {after / s_after:.2f} | {med(name, 'recovery_s'):.2f} | "
                     f"{max(r[name]['optimizer_share'] for r in rounds):.2f} | {'yes' if exact else 'NO'} |")
    lines += ["", "Each Odyssey column is compared with stock over the same iterations (the first ones are slower on "
              "this machine). After the recovery one rank fewer shares the 2 cores, which is why it can beat stock "
              "with all ranks. After a failure every variant runs Odyssey's executor with per-layer gradient all-reduces "
              "and Megatron's optimizer (plain, or cut down to replicated shards for the distributed optimizer: stage 0's "
              "three survivors keep two thirds of its state each, stage 1's four ranks half, and all-gather their "
              "shards of the weights after each step); with --overlap-grad-reduce each layer's all-reduce starts inside the last "
              "backward (the DDP row, on the same 4 ranks, is the same step without overlap: "
              f"{_after_ratio(rounds, '--overlap-grad-reduce', 'DDP')}; with the distributed optimizer, 8 ranks: "
              f"{_after_ratio(rounds, 'distributed optimizer, 2 instances, both overlaps', 'distributed optimizer, 2 instances')}"
              "). Before the failure --overlap-param-gather defers Megatron's weight all-gather into the next forward; "
              "rebuilt stages gather right after the step. "
              "At this model size an iteration is mostly fixed overhead (Python, gloo on loopback, 2 cores shared by all "
              "ranks), so the ratios say little about large models on GPUs.", END]
    return "\n".join(lines)


def plot(rounds: list[dict[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(VARIANTS)
    keys = [("stock_before_ms", f"stock, iterations 2-{FAIL_AT - 1}"), ("before_ms", "Odyssey, same iterations"),
            ("stock_after_ms", f"stock, iterations {FAIL_AT + 3}-{ITERS}"),
            ("after_ms", "Odyssey, same iterations, after the recovery (one rank fewer)")]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.2
    for k, (key, label) in enumerate(keys):
        values = [statistics.median(r[n][key] for r in rounds) for n in names]
        ax.bar([i + (k - 1.5) * width for i in range(len(names))], values, width, label=label)
    ax.set_xticks(range(len(names)), [f"{textwrap.fill(n, 24)}\n({rounds[0][n]['ranks']} CPU ranks)" for n in names],
                  fontsize=8)
    ax.set_ylabel("per-iteration time (ms, median)")
    ax.set_title(f"Megatron-LM flags with Odyssey: one rank killed at iteration {FAIL_AT} (CPU, gloo)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    rounds = run_rounds(args.repeats, one_round, 26000)
    text = render(rounds, "MEGATRON_LM_PATH=... python " + " ".join(sys.argv))
    print(text)
    if args.write:
        write_section(args.write, text, START, END)
    if args.plot:
        plot(rounds, args.plot)


if __name__ == "__main__":
    main()
