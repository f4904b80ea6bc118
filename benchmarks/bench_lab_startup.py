"""What a lab job's start costs on CPU: megatron's mock dataset against ours, and a whole tiny job.

    python benchmarks/bench_lab_startup.py [--repeats 3]

- *dataset*: ``build_train_dataset`` at the tests' sequence length (16), once with megatron's ``MockGPTDataset``
  (100,000 mock documents) and once with ``LabMockGPTDataset`` (``runtime.data.MOCK_DOCUMENTS``), in this process;
- *job*: the recovery tests' job (``odyssey train``'s launcher, 6 CPU ranks, PP=2 x DP=3, 3 steps, no fault):
  wall time from ``launch`` to its return, and the CPU time of its whole process tree (agent and ranks).

Medians over ``--repeats`` runs. Run it with another checkout first on ``PYTHONPATH`` to compare two versions
of the job on the same machine the same hour.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from pathlib import Path

from megatron_odyssey.runtime.config import TrainConfig

JOB = dict(nproc=6, tp=1, pp=2, layers=6, hidden=32, heads=4, seq=16, global_batch=12, micro_batch=1, steps=3, seed=7)


def build_seconds(dataset_class) -> float:
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    from megatron_odyssey.runtime import data

    cfg = TrainConfig(**JOB).data_config()
    config = data.gpt_dataset_config(cfg, data.ByteTokenizer())
    start = time.perf_counter()
    BlendedMegatronDatasetBuilder(dataset_class, [cfg.num_samples, 1, 1], lambda: True, config).build()
    return time.perf_counter() - start


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def job_seconds() -> tuple[float, float]:
    from megatron_odyssey.standalone.launcher import launch

    with tempfile.TemporaryDirectory(prefix="bench-lab-") as tmp:
        cfg = TrainConfig(**JOB, report=str(Path(tmp) / "report.json"))
        cpu, start = children_cpu(), time.perf_counter()
        launch(cfg, Path(tmp) / "run", quiet=True)
        return time.perf_counter() - start, children_cpu() - cpu


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    from megatron.core.datasets.gpt_dataset import MockGPTDataset

    from megatron_odyssey.runtime import data

    megatrons = statistics.median(build_seconds(MockGPTDataset) for _ in range(args.repeats))
    line = f"dataset build, seq 16: megatron's MockGPTDataset {megatrons:.3f} s"
    if hasattr(data, "LabMockGPTDataset"):  # (absent from the code before it)
        ours = statistics.median(build_seconds(data.LabMockGPTDataset) for _ in range(args.repeats))
        line += f", LabMockGPTDataset {ours:.3f} s ({megatrons / ours:.1f}x)"
    print(line)
    runs = [job_seconds() for _ in range(args.repeats)]
    print(f"job (6 ranks, 3 steps), code from {Path(data.__file__).parents[2]}: wall "
          f"{statistics.median(w for w, _ in runs):.2f} s, CPU {statistics.median(c for _, c in runs):.2f} s "
          f"(medians of {args.repeats}: {[(round(w, 2), round(c, 2)) for w, c in runs]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
