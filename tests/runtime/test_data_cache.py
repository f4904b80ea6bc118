"""Several processes build the same Megatron dataset index cache at once (as the ranks of a fresh
``odyssey demo`` do): every one must succeed and see the same samples. Real processes, megatron's
real builder; without the cache lock one of them reads another's half-written ``.npy``."""
from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path


from megatron_odyssey.runtime import data as D

PROCS = 4


def test_concurrent_builders_share_one_cache(tmp_path: Path) -> None:
    from _runtime_workers import build_cached_dataset_worker

    prefix = D.build_indexed_dataset(tmp_path / "corpus")
    cache = tmp_path / "cache"
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(PROCS), ctx.Queue()
    num_samples = 200_000  # many epochs of the corpus: megatron writes a few MB of index
    procs = [ctx.Process(target=build_cached_dataset_worker, args=(prefix, str(cache), num_samples, barrier, out))
             for _ in range(PROCS)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    failures = [r for ok, r in results if not ok]
    assert not failures, failures[0]
    built = [b for _, (b, _) in results]
    assert sum(built) == 1, built  # one process built the cache; the others waited and loaded it
    first = results[0][1][1]
    assert len(first) > 32 and all(tokens == first for _, (_, tokens) in results)
    assert len([f for f in os.listdir(cache) if f.endswith(".npy")]) == 3  # one cache
