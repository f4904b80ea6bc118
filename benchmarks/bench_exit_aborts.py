"""How often a Megatron-LM job that trained to its end aborts at exit (``megatron_lm.clean_exit``).

    MEGATRON_LM_PATH=/path/to/Megatron-LM python benchmarks/bench_exit_aborts.py [--runs 30] [--root CHECKOUT]

Runs the tiny CPU GPT with evaluation (evaluating 2 iterations after every 2nd one, 5 iterations; the job of
``stock_evaluating`` in the Megatron-LM tests) under torchrun without ``--odyssey`` ``--runs`` times, one after the
other, and counts the runs in which a rank died of SIGABRT with "terminate called without an active exception"
(pytorch/pytorch#190489). ``--root``: the megatron-odyssey checkout whose adaptor the job imports (a worktree of an
older commit measures the job before the fix). Progress on stderr (tqdm); the count and each run's wall time on
stdout.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="jobs to run (default 30)")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the megatron-odyssey checkout the jobs import (default: this one)")
    parser.add_argument("--port", type=int, default=26500, help="first torchrun port; run k uses PORT + k")
    args = parser.parse_args()
    megatron_lm = os.environ.get("MEGATRON_LM_PATH")
    if not megatron_lm:
        parser.error("set MEGATRON_LM_PATH to a Megatron-LM checkout")
    sys.path.insert(0, str(args.root.resolve()))  # (job_env puts the checkout this imports on the ranks' path)
    from tqdm import tqdm

    from megatron_odyssey.megatron_lm.cpu_mode import tiny_gpt_flags
    from megatron_odyssey.testing.megatron_lm_job import run_stock, with_evaluation

    flags = with_evaluation(tiny_gpt_flags(5), 2, 2)
    aborted, other, walls = 0, 0, []
    with tempfile.TemporaryDirectory() as tmp:
        for k in tqdm(range(args.runs), desc="jobs", file=sys.stderr):
            job = run_stock(megatron_lm, Path(tmp) / f"run{k}", flags, args.port + k)
            walls.append(job.wall_s)
            if "terminate called without an active exception" in job.logs:
                aborted += 1
            elif job.returncode != 0:
                other += 1
                print(job.logs[-2000:], file=sys.stderr)
    print(f"root {args.root}: {aborted} of {args.runs} jobs aborted at exit, {other} failed otherwise; "
          f"median wall {statistics.median(walls):.1f} s")


if __name__ == "__main__":
    main()
