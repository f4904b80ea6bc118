"""Dropout randomness keyed to what is computed, not to who computes it.

Megatron seeds its generators per rank (default generator per pipeline stage, a model-parallel stream
per TP rank) and draws dropout masks from them in order. After a failure a rerouted micro-batch runs on
another rank, and a re-arranged layer on another node, so its masks come from another stream, and the
model drifts away from fault-free training. Here every layer's forward of a micro-batch first re-seeds
the generators from (job seed, step, global micro-batch, global layer) - and, for Megatron's
model-parallel streams, the TP rank, as Megatron keeps TP ranks' attention dropout apart - so the
masks are the same whichever rank runs it, in whichever layout (as ElasWave re-shards RNG state).

The executor (and the reference trainer, and Megatron's own schedule in generation 0) say which
micro-batch runs next with :func:`set_micro_batch`; :func:`install` hooks every transformer layer and the
embedding of a stage model. Only installed when some dropout is on (cost: a re-seed per layer per
micro-batch; ``benchmarks/bench_dropout_rng.py``).
"""
from __future__ import annotations

import hashlib
from typing import Any

_CURRENT: list[tuple[int, int] | None] = [None]  # (step, global micro-batch) being run by this process


def set_micro_batch(step: int, micro_batch: int) -> None:
    _CURRENT[0] = (step, micro_batch)


def key_seed(seed: int, step: int, micro_batch: int, layer: int, stream: str) -> int:
    """A 63-bit seed, a pure function of what is being computed."""
    digest = hashlib.sha256(f"{seed}|{step}|{micro_batch}|{layer}|{stream}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def reseed(seed: int, layer: int, tp_rank: int) -> None:
    """Seed the default generator(s) and every stream of Megatron's model-parallel RNG tracker for
    ``layer`` of the current micro-batch (no-op before any micro-batch was set)."""
    current = _CURRENT[0]
    if current is None:
        return
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from .accelerator import get_accelerator

    step, micro_batch = current
    get_accelerator().manual_seed(key_seed(seed, step, micro_batch, layer, "default"))
    tracker = get_cuda_rng_tracker()
    names = list(tracker.get_states()) or ["model-parallel-rng"]
    tracker.reset()
    for name in names:
        tracker.add(name, key_seed(seed, step, micro_batch, layer, f"{name}/tp{tp_rank}"))


def install(model: Any, seed: int, tp_rank: int) -> list[Any]:
    """Forward pre-hooks re-seeding before the embedding (layer -1) and each transformer layer (its global
    index: both hosts' stage models carry global ``layer_number``s). Returns the hook handles."""
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.transformer.transformer_layer import TransformerLayer

    handles = []
    for module in model.modules():
        if isinstance(module, TransformerLayer):
            layer = module.layer_number - 1
        elif isinstance(module, LanguageModelEmbedding):
            layer = -1
        else:
            continue
        handles.append(module.register_forward_pre_hook(
            lambda _m, _args, layer=layer: reseed(seed, layer, tp_rank)))
    return handles
