"""On one GPU, side by side in one run: Megatron-LM ``pretrain_gpt.py`` with ``--odyssey`` vs stock, and
``odyssey train``'s executor after a reroute vs the planner's estimate.

    MEGATRON_LM_PATH=/path/to/Megatron-LM python benchmarks/bench_gpu.py [--rounds 2] [--write docs/benchmarks.md]

1. Hand-off overhead (issue 10, part 4): stock Megatron-LM (torchrun) and the same job under
   ``odyssey-launch --odyssey`` alternate, ``--rounds`` times each: 1 GPU, NCCL, bf16, 8 layers x hidden
   2048, seq 2048, micro-batch 2, global batch 16, 30 iterations. Per run the median of Megatron's own
   per-iteration time over iterations 6-30; reported: the median over runs and the ratio. Before a
   failure an Odyssey job runs Megatron's own schedule and DDP; only the commit guard is added.
2. Executor vs estimate: ``odyssey train`` with 4 ranks sharing the GPU (PP=2 x DP=2, gloo with
   host-staged point-to-point messages), rank 1 killed in step 2, forced reroute; the step time the
   agent logs after recovery vs the reroute candidate's estimated step time. Caveat printed with the
   result: the estimator models one device per rank, here four ranks take turns on one.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

from docs_section import write_section
from megatron_odyssey.testing.megatron_lm_job import gpu_gpt_flags, run_odyssey, run_stock, same_training

START, END = "<!-- gpu:start -->", "<!-- gpu:end -->"

ITERS = 30
FLAGS = gpu_gpt_flags(ITERS, layers=8, hidden=2048, heads=16, seq=2048, micro_batch=2, global_batch=16)


def steady_ms(job) -> float:
    ms = job.iteration_ms()
    return statistics.median(ms[i] for i in range(6, ITERS + 1))


def handoff(mlm: str, work: Path, rounds: int) -> dict:
    stock, ody, exact = [], [], True
    for r in range(rounds):
        s = run_stock(mlm, work / f"stock{r}", FLAGS, 29700 + 20 * r, nproc=1, gpu=True)
        assert s.returncode == 0, s.logs[-3000:]
        o = run_odyssey(mlm, work / f"odyssey{r}", FLAGS, 29710 + 20 * r, nproc=1, gpu=True)
        assert o.returncode == 0, o.logs[-3000:]
        stock.append(steady_ms(s))
        ody.append(steady_ms(o))
        exact &= same_training(o.iterations(), s.iterations())
        print(f"round {r + 1}/{rounds}: stock {stock[-1]:.1f} ms, odyssey {ody[-1]:.1f} ms", flush=True)
    return {"stock_ms": stock, "odyssey_ms": ody, "exact": exact}


def executor_vs_estimate(work: Path) -> dict:
    from megatron_odyssey.runtime.config import TrainConfig
    from megatron_odyssey.standalone.launcher import launch

    cfg = TrainConfig(nproc=4, pp=2, layers=8, hidden=1024, heads=16, seq=1024, global_batch=16, micro_batch=2,
                      steps=14, shared_device=True, policy="reroute", fail=["step=2,rank=1,phase=backward,kind=kill"],
                      report=str(work / "train.json"), checkpoint_interval=0)
    launch(cfg, work / "train", quiet=True)
    report = json.loads((work / "train.json").read_text())
    (failure,) = report["failures"]
    estimate = next(c["step_time_s"] for c in failure["candidates"] if c["policy"] == "reroute")
    before = statistics.median(s["time_s"] for s in report["steps"] if 0 < s["step"] < 2)
    after = statistics.median(s["time_s"] for s in report["steps"] if s["step"] >= 5)
    return {"estimate_s": estimate, "measured_s": after, "before_s": before, "profile": report["profile"],
            "devices": report["devices"]}


def render(h: dict, e: dict, command: str, device: str) -> str:
    s, o = statistics.median(h["stock_ms"]), statistics.median(h["odyssey_ms"])
    return "\n".join([
        START, "## On one GPU: hand-off overhead and executor vs estimate (issue 10)", "",
        f"Command: `{command}`  ", f"Machine: {device}, Python {platform.python_version()}, Megatron-LM core_r0.16.0.", "",
        "| Megatron-LM, 1 GPU, bf16, 8 layers x 2048, seq 2048, mbs 2, gbs 16 | per-iteration ms (median of runs) | runs |",
        "|---|---|---|",
        f"| stock (torchrun) | {s:.1f} | {', '.join(f'{x:.1f}' for x in h['stock_ms'])} |",
        f"| `--odyssey` (odyssey-launch), no failure | {o:.1f} | {', '.join(f'{x:.1f}' for x in h['odyssey_ms'])} |",
        f"| ratio odyssey / stock | **{o / s:.3f}** | |", "",
        f"Logged loss, grad norm, learning rate and consumed samples equal to stock in every iteration: "
        f"**{'yes' if h['exact'] else 'NO'}**.", "",
        "| `odyssey train`, 4 ranks sharing the GPU, PP=2 x DP=2, 8 layers x 1024, reroute after rank 1 dies | s/step |",
        "|---|---|",
        f"| before the failure (4 ranks) | {e['before_s']:.3f} |",
        f"| after the reroute, measured (3 ranks) | {e['measured_s']:.3f} |",
        f"| after the reroute, planner's estimate (profile `{e['profile']}`) | {e['estimate_s']:.3f} |",
        f"| measured / estimate | {e['measured_s'] / e['estimate_s']:.2f} |", "",
        "The estimator models one device per rank; here the ranks take turns on one GPU and exchange "
        "activations through host memory over gloo, so the measured step can differ from the "
        "estimate; the planner models each rank as owning 1/N of the device under `--shared-device`. "
        "A faithful executor-vs-estimate figure needs one GPU per rank.", END,
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--write", type=Path, default=None, help="update this markdown file's GPU section")
    args = parser.parse_args()
    mlm = os.environ.get("MEGATRON_LM_PATH")
    if not mlm or not (Path(mlm) / "pretrain_gpt.py").exists():
        sys.exit("set MEGATRON_LM_PATH to a Megatron-LM checkout")
    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    device = f"1x {torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    with tempfile.TemporaryDirectory() as d:
        h = handoff(mlm, Path(d), args.rounds)
        e = executor_vs_estimate(Path(d))
    text = render(h, e, "MEGATRON_LM_PATH=... python " + " ".join(sys.argv), device)
    print(text)
    if args.write:
        write_section(args.write, text, START, END)


if __name__ == "__main__":
    main()
