"""Fault-free single-process reference: the whole model on one rank, every micro-batch of the
global batch in order, the same loss normalisation and optimizer. Deliberately shares nothing with
the executor, groups or gradient sync, so exactness tests compare against an independent run.

``python -m megatron_odyssey.testing.reference --config CFG --out FILE`` writes
``{"losses": [...], "params": {global name: tensor}}``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from ..runtime.config import TrainConfig

# Every TrainConfig field the reference run reads, directly or through model_config() / data_config();
# the rest (ranks, plan, faults, timeouts...) describe the job under test, not the fault-free run.
REFERENCE_FIELDS = ("layers", "hidden", "heads", "seq", "global_batch", "micro_batch", "steps", "seed", "ffn_hidden",
                    "vocab", "lr", "hidden_dropout", "attention_dropout", "data_path")


def run_reference(cfg: TrainConfig) -> dict:
    from megatron.core import parallel_state

    from ..runtime.accelerator import bind_rank_device, enable_cpu_mode, get_accelerator, seed_all
    from ..runtime.data import MicroBatchData
    from ..runtime.dropout_rng import set_micro_batch
    from ..runtime.model import build_stage_model, stage_forward

    device = bind_rank_device(0)  # the device a one-rank `odyssey train` would use
    store = tempfile.mktemp(prefix="odyssey-ref-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    if get_accelerator().is_cpu:
        enable_cpu_mode()
    seed_all(cfg.seed, tp_rank=0)
    model = build_stage_model(cfg.model_config(), 0, cfg.layers).to(device)
    if cfg.dropout:
        from ..runtime import dropout_rng

        dropout_rng.install(model, cfg.seed, tp_rank=0)
    data = MicroBatchData(cfg.data_config())
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    losses = []
    for step in range(cfg.steps):
        optimizer.zero_grad(set_to_none=True)
        batches = data.global_batch(step)
        tokens = float(sum(b["loss_mask"].sum() for b in batches))
        total = 0.0
        for j, batch in enumerate(batches):
            batch = {k: v.to(device) for k, v in batch.items()}
            set_micro_batch(step, j)
            per_token = stage_forward(model, batch)
            loss = (per_token.float() * batch["loss_mask"].float()).sum() / tokens
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        losses.append(total)
    out = {"losses": losses, "params": {k: v.cpu() for k, v in model.global_state_dict(gather=False).items()},
           "device": str(device)}
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return out


def reference_in_subprocess(cfg: TrainConfig, folder: Path) -> dict:
    """:func:`run_reference` in a process of its own (it needs a fresh torch.distributed world and
    parallel_state, which a test or CLI process may already hold): the config and the result are kept in
    ``folder``. A failed run raises with its stderr."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg.save(folder / "reference_config.json")
    proc = subprocess.run([sys.executable, "-m", "megatron_odyssey.testing.reference", "--config",
                           str(folder / "reference_config.json"), "--out", str(folder / "reference.pt")],
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"the fault-free reference run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return torch.load(folder / "reference.pt")


def reference_key(cfg: TrainConfig) -> str:
    """Names one fault-free run: jobs that differ only in layout, faults or timeouts share it."""
    fields = json.dumps({name: getattr(cfg, name) for name in REFERENCE_FIELDS}, sort_keys=True)
    return hashlib.sha256(fields.encode()).hexdigest()[:16]


def cached_reference(cfg: TrainConfig, cache: Path) -> dict:
    """:func:`reference_in_subprocess`, run once per :func:`reference_key` in ``cache``, a folder that every
    process of a test session shares (pytest-xdist workers too): the lock makes a second process wait for the
    first one's run instead of repeating it (each run is a fresh interpreter importing megatron-core, seconds
    of CPU)."""
    from filelock import FileLock

    folder = Path(cache) / reference_key(cfg)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{folder}.lock"):
        if not (folder / "reference.pt").exists():
            return reference_in_subprocess(cfg, folder)
    return torch.load(folder / "reference.pt")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = run_reference(TrainConfig.load(args.config))
    torch.save(result, f"{args.out}.partial")
    os.replace(f"{args.out}.partial", args.out)  # a run killed while saving leaves no file to be taken for a result


if __name__ == "__main__":
    main()
