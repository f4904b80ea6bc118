"""What keyed dropout costs when nothing fails: a stage's forward+backward with and without the re-seeding
hooks of ``runtime.dropout_rng`` (one re-seed of the default generator and of Megatron's model-parallel
RNG tracker per layer per micro-batch).

    python benchmarks/bench_dropout_rng.py [--layers 8 --hidden 256 --seq 256 --repeats 30]
        [--write docs/benchmarks.md]

One process, the megatron-core stage model the runtime trains, dropout 0.1 in both runs, on this machine's
device (CPU here); the two variants are interleaved, medians compared.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from docs_section import write_section

START, END = "<!-- bench_dropout_rng:start -->", "<!-- bench_dropout_rng:end -->"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--write", type=Path, default=None)
    args = p.parse_args(argv)
    from megatron.core import parallel_state

    from megatron_odyssey.runtime import dropout_rng
    from megatron_odyssey.runtime.accelerator import enable_cpu_mode, seed_all
    from megatron_odyssey.runtime.model import ModelConfig, build_stage_model, stage_forward

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    enable_cpu_mode()
    seed_all(1, tp_rank=0)
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                      ffn_hidden_size=4 * args.hidden, seq_length=args.seq, vocab_size=512,
                      hidden_dropout=0.1, attention_dropout=0.1)
    plain, keyed = build_stage_model(cfg, 0, args.layers), build_stage_model(cfg, 0, args.layers)
    dropout_rng.install(keyed, seed=1, tp_rank=0)
    s = args.seq
    batch = {"tokens": torch.randint(0, 512, (1, s)), "position_ids": torch.arange(s)[None],
             "labels": torch.randint(0, 512, (1, s)), "loss_mask": torch.ones(1, s),
             "attention_mask": torch.ones(1, 1, s, s, dtype=torch.bool).tril().logical_not()}
    times: dict[str, list[float]] = {"plain": [], "keyed": []}
    for i in range(args.repeats + 3):
        for name, model in (("plain", plain), ("keyed", keyed)):
            dropout_rng.set_micro_batch(0, i)
            t0 = time.perf_counter()
            stage_forward(model, batch).float().mean().backward()
            if i >= 3:  # warm-up
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    ratio = med["keyed"] / med["plain"]
    line = (f"{args.layers} layers, hidden {args.hidden}, sequence {args.seq}, dropout 0.1, forward+backward of one "
            f"micro-batch, median of {args.repeats}: plain {med['plain']:.1f} ms, keyed {med['keyed']:.1f} ms, "
            f"ratio {ratio:.3f}")
    print(line)
    if args.write:
        body = "\n".join([START, "## Keyed dropout: cost without failures", "",
                          f"`python benchmarks/bench_dropout_rng.py --layers {args.layers} --hidden {args.hidden} "
                          f"--seq {args.seq} --repeats {args.repeats}`, on {platform.node()} (CPU, one thread).", "",
                          line + ".", "", "Not measured on a GPU yet: there a re-seed of Megatron's CUDA RNG tracker "
                          "copies generator states between host and device once per layer per micro-batch.", END])
        write_section(args.write, body, START, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
