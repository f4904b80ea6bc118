"""Fixtures for the runtime tests: a one-process gloo world with megatron's parallel state, in CPU mode.

Everything here is real torch.distributed + megatron-core; nothing is mocked.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator

import pytest

# Worker functions for torch.multiprocessing.spawn live in a sibling module; spawned children
# inherit sys.path, so they can import it whatever pytest's import mode is.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

# megatron-core warns at import that Apex / Transformer Engine are absent; expected on CPU.
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")


@pytest.fixture(scope="session")
def gloo_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """World of size 1 over gloo (FileStore), ``initialize_model_parallel(1, 1)``, CPU mode on.

    Session-scoped: torch.distributed and megatron's parallel_state are process-global.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_odyssey.runtime.accelerator import disable_cpu_mode, enable_cpu_mode

    store_file = tmp_path_factory.mktemp("gloo") / "store"
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    enable_cpu_mode()
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        disable_cpu_mode()
        if created:
            dist.destroy_process_group()


@pytest.fixture(scope="session")
def two_rank_results(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    """Run the 2-process checks once (torch.multiprocessing.spawn, gloo over a FileStore) and
    return rank 0's results: TP=1 vs TP=2 losses/gradients and per-rank micro-batches.

    One spawn serves the model and data tests: each child pays megatron's import time.
    """
    import torch
    import torch.multiprocessing as mp

    from _runtime_workers import tp_and_data_worker

    work = tmp_path_factory.mktemp("two_ranks")
    out = work / "results.pt"
    mp.spawn(tp_and_data_worker, args=(2, str(work / "store"), str(out), str(work)), nprocs=2, join=True)
    return torch.load(out, weights_only=False)
