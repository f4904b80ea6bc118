"""A cold planner decision against the number of micro-batches per pipeline.

    python benchmarks/bench_planner_batches.py [--repeats 3] [--baseline /path/to/other/checkout]
        [--write docs/benchmarks.md] [--plot docs/planner_batches.png]

``bench_planner.py`` times decisions at 8 micro-batches per pipeline, where a play is cheap. Jobs on few
data-parallel replicas run hundreds: Llama-2-70B on 128 H100s (TP=8 x PP=8 x DP=2) at a global batch of 1024
runs 512 per pipeline, and every candidate the planner weighs plays that many through every stage. The plan
cache answers a first failure from its background precomputation; a second failure (and that precomputation
itself) waits for a cold decision.

Cases: that 70B job, one node of stage 5 lost; and the paper's 16-device Llama-2-7B job (PP=4 x DP=4, TP=1),
one node of stage 1 lost. Global batch = micro-batches per pipeline x DP. Each decision runs in a fresh
process (no memoised plays) pinned to one core; medians over ``--repeats``. ``--baseline``: the same
decisions with that checkout's ``megatron_odyssey`` first on the path, taking turns with this one decision by
decision, so both versions see the same machine; the table says whether both chose the same plan at the same
estimated step time.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from docs_section import write_section

MICRO_BATCHES = (64, 128, 256, 512)
CASES = {
    # name: (model shape, tp, pp, dp, failed node)
    "llama2-70b, 128 H100s (TP8 PP8 DP2)": ("L70", 8, 8, 2, 5),
    "llama2-7b, 16 H100s (TP1 PP4 DP4)": ("L7", 1, 4, 4, 5),
}
START, END = "<!-- planner-batches:start -->", "<!-- planner-batches:end -->"

CHILD = r"""
import json, sys, time
from dataclasses import replace
from megatron_odyssey.planning.analytic import BF16, ModelShape, analytic_profile
from megatron_odyssey.planning.devices import Layout, device_params
from megatron_odyssey.planning.plan import symmetric_plan
from megatron_odyssey.planning.planner import Planner, PlannerOptions
SHAPES = dict(
    L70=dict(num_layers=80, hidden=8192, ffn_hidden=28672, heads=64, query_groups=8, vocab=32000, seq_length=4096,
             micro_batch=1),
    L7=dict(num_layers=32, hidden=4096, ffn_hidden=11008, heads=32, query_groups=32, vocab=32000, seq_length=4096,
            micro_batch=1))
shape, tp, pp, dp, failed, m = json.loads(sys.argv[1])
dev = replace(device_params("cuda", Layout(tp, dp, pp, ranks_per_node=8), name="h100", flops=790e12,
                            memory_bytes=80 * 2**30), layer_efficiency=300 / 790)
prof = analytic_profile(ModelShape(**SHAPES[shape], tp=tp, sequence_parallel=tp > 1), BF16, dev)
gb = m * dp
planner = Planner(prof, gb, 1, PlannerOptions(tp=tp))
current = symmetric_plan(pp, dp, SHAPES[shape]["num_layers"], gb)
t = time.perf_counter()
d = planner.decide(current, {failed})
print(json.dumps({"s": time.perf_counter() - t, "policy": d.policy, "step_s": d.chosen.step_time_s}))
"""


def decide_once(case: tuple, m: int, checkout: Path | None) -> dict:
    env = dict(os.environ)
    if checkout is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(checkout), env.get("PYTHONPATH", "")]))
    pin = ["taskset", "-c", str(min(os.sched_getaffinity(0)))] if hasattr(os, "sched_getaffinity") else []
    out = subprocess.run([*pin, sys.executable, "-c", CHILD, json.dumps([*case, m])], env=env, check=True,
                         capture_output=True, text=True, cwd="/").stdout
    return json.loads(out.strip().splitlines()[-1])


def measure(checkouts: dict[str, Path], repeats: int) -> dict[str, dict]:
    """label -> (case, m) -> median and choice. The checkouts take turns, decision by decision, so that both see
    the same machine."""
    runs: dict[str, dict] = {label: {} for label in checkouts}
    for name, case in CASES.items():
        for m in MICRO_BATCHES:
            for _ in range(repeats):
                for label, checkout in checkouts.items():
                    runs[label].setdefault((name, m), []).append(decide_once(case, m, checkout))
            for label in checkouts:
                got = runs[label][(name, m)]
                runs[label][(name, m)] = {"median_s": statistics.median(r["s"] for r in got), "policy": got[0]["policy"],
                                          "step_s": got[0]["step_s"]}
                print(f"{label:8s} {name}  m={m:4d}  cold median {runs[label][(name, m)]['median_s']:.3f} s  "
                      f"({got[0]['policy']}, step {got[0]['step_s']:.4f} s)", flush=True)
    return runs


def commit_of(checkout: Path) -> str:
    """The checkout's commit, to name the baseline by (its path is only where it lay on this machine)."""
    out = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or checkout.name


def render(now: dict, base: dict | None, command: str, plot: Path | None, base_name: str = "baseline") -> str:
    lines = [START, "## Planner: cold decision against micro-batches per pipeline", "",
             f"Command: `{command}`  ",
             f"Machine: `{platform.platform()}`, {os.cpu_count()} cores, each decision in a fresh process pinned to "
             f"one core, Python {platform.python_version()}.  ",
             "One node lost; global batch = micro-batches per pipeline x DP; medians."
             + (f" Baseline: commit `{base_name}`, run in turns with this one." if base else ""), ""]
    head = "| case | micro-batches per pipeline | chosen | cold median (s) |"
    rule = "|---|---|---|---|"
    if base:
        head += " baseline (s) | baseline / now | same plan and step time |"
        rule += "---|---|---|"
    lines += [head, rule]
    for (name, m), r in now.items():
        row = f"| {name} | {m} | {r['policy']} | {r['median_s']:.3f} |"
        if base:
            b = base[(name, m)]
            same = b["policy"] == r["policy"] and abs(b["step_s"] - r["step_s"]) <= 1e-9 * b["step_s"]
            row += f" {b['median_s']:.3f} | {b['median_s'] / r['median_s']:.1f}x | {'yes' if same else 'NO'} |"
        lines.append(row)
    if plot:
        lines += ["", f"![cold decision against micro-batches]({plot.name})"]
    lines.append(END)
    return "\n".join(lines)


def draw(now: dict, base: dict | None, path: Path, base_name: str = "baseline") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, name in enumerate(CASES):
        colour = f"C{i}"
        ax.plot(MICRO_BATCHES, [now[(name, m)]["median_s"] for m in MICRO_BATCHES], "o-", color=colour,
                label=f"{name}: now")
        if base:
            ax.plot(MICRO_BATCHES, [base[(name, m)]["median_s"] for m in MICRO_BATCHES], "s--", color=colour,
                    alpha=0.6, label=f"{name}: {base_name}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(MICRO_BATCHES, [str(m) for m in MICRO_BATCHES])
    ax.set_xlabel("micro-batches per pipeline")
    ax.set_ylabel("cold decision, one failed node (s, log)")
    ax.set_title("Planner decision time against micro-batches per pipeline")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline", type=Path, default=None, help="another checkout to time side by side")
    p.add_argument("--write", type=Path, default=None, help="refresh this section of this markdown file")
    p.add_argument("--plot", type=Path, default=None, help="draw the medians into this PNG")
    args = p.parse_args(argv)
    here = Path(__file__).resolve().parents[1]
    runs = measure({"now": here, **({"baseline": args.baseline.resolve()} if args.baseline else {})}, args.repeats)
    now, base = runs["now"], runs.get("baseline")
    base_name = commit_of(args.baseline) if args.baseline else "baseline"
    if args.plot:
        draw(now, base, args.plot, base_name)
    text = render(now, base, "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
                  args.plot, base_name)
    print(text)
    if args.write:
        write_section(args.write, text, START, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
