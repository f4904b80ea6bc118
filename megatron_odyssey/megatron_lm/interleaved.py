"""Interleaved (virtual) pipeline stages until the first failure, and the hand-off after it.

Generation 0 runs Megatron's interleaved schedule as it is: pipeline rank i of p holds virtual stages
i, i + p, i + 2p, ... (v chunks of L / (p v) layers). The planner's layouts give every node one contiguous
layer range, so at the first failure the survivors first move layers until each live node holds the
contiguous stage of the same pipeline rank (layers [i L/p, (i + 1) L/p) of the non-interleaved layout,
which the agent's base plan describes), and from there reroutes and reconfigurations proceed as without
interleaving; rebuilt stages are not interleaved. The embedding (virtual stage 0) and the output layer
(the last virtual stage) are already where the contiguous layout wants them. The same node sets hold a
pipeline rank's layers in both layouts, so a failure loses a layer in one exactly when it loses one in
the other, and the planner's restart decision holds for both.
"""
from __future__ import annotations

import re
from typing import Any

#: a global layer parameter name, ``decoder.layers.<k>.<rest>``
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


class InterleavedCapture:
    """Generation 0's captured state of every chunk of an interleaved rank (``inner``: a ``runtime.state``
    dict, or the distributed optimizer's shares), to be moved to the contiguous layout first."""

    def __init__(self, inner: Any):
        self.inner = inner


def chunk_layer_start(chunk: Any) -> int:
    """First global layer index of a Megatron model chunk (its layers keep global 1-based numbers)."""
    from megatron.core.utils import get_attr_wrapped_model

    layers = get_attr_wrapped_model(chunk, "decoder").layers
    return int(layers[0].layer_number) - 1 if len(layers) else 0


def chunk_layer_count(chunk: Any) -> int:
    """How many transformer layers a Megatron model chunk holds."""
    from megatron.core.utils import get_attr_wrapped_model

    return len(get_attr_wrapped_model(chunk, "decoder").layers)


def reshuffle_transfers(num_layers: int, pp: int, dp: int, vpp: int, live: set[int]) -> list[tuple[int, int, int]]:
    """(unit, source node, destination node) moving each layer from its interleaved pipeline rank to its
    contiguous one, for every live destination replica; sources spread over the live replicas. Node of
    (pipeline rank s, replica d) = s * dp + d, as in ``planning.plan.symmetric_plan``."""
    if num_layers % (pp * vpp):
        raise ValueError(f"{num_layers} layers do not split into {pp} x {vpp} equal virtual stages")
    per_chunk, per_stage = num_layers // (pp * vpp), num_layers // pp
    out = []
    for layer in range(num_layers):
        have, want = (layer // per_chunk) % pp, layer // per_stage
        if have == want:
            continue
        sources = [have * dp + d for d in range(dp) if have * dp + d in live]
        if not sources:
            continue  # every holder is dead: the planner restarts from a checkpoint instead
        for d in range(dp):
            if want * dp + d in live:
                out.append((layer + 1, sources[d % len(sources)], want * dp + d))
    return out


def shapes_for_layers(state: dict[str, Any], layers: set[int]) -> dict[str, Any]:
    """Names and shapes of ``layers``' parameters, from the layers this rank captured (every transformer
    layer has the same parameters)."""
    template: dict[str, Any] = {}
    for name, st in state.items():
        m = _LAYER.match(name)
        if m:
            template.setdefault(m.group(2), st["param"].shape)
    return {f"decoder.layers.{k}.{rest}": shape for k in layers for rest, shape in template.items()}
