"""The loss a step commits, from every rank's *ready* value: what Megatron-LM's ``train_step`` would have printed.

Each rank appends its share to the step's *ready* key (``rank=value;``); the agent adds the shares up in rank
order. In a Megatron-LM job it does so in the float arithmetic Megatron's own step uses, so the loss logged after a
failure equals stock Megatron-LM's digit for digit, whatever plan the ranks ran.
"""
from __future__ import annotations

import struct


def ready_shares(value: bytes) -> dict[int, bytes]:
    """Every rank's *ready* value of a step, from the step's appended key (``rank=value;`` per rank)."""
    out = {}
    for item in value.split(b";"):
        if item:
            rank, share = item.split(b"=", 1)
            out[int(rank)] = share
    return out


def committed_loss(shares: list[bytes], data_parallel: int = 1, per_micro_batch: bool = False) -> float:
    """The step's loss from every rank's *ready* value: a share of the normalised loss (``"x"``), a loss sum and
    its token count (``"x n"``, Megatron's own step) whose totals are divided, or each micro-batch's loss sum and
    tokens (``"p j:x:n ..."``, a Megatron-LM plan step), added up as Megatron-LM's ``train_step`` does on the
    ``data_parallel`` ranks of generation 0: in fp32, each rank over its micro-batches j = k * DP + d in order,
    then over the ranks, and divided in fp32 (the printed loss is that float32). ``per_micro_batch``: as
    core_r0.12.0, whose loss function all-reduces each micro-batch's values over the ranks (k-th micro-batches
    summed over d), and whose ``train_step`` then adds those up over k."""
    plain, numerator, tokens = 0.0, 0.0, 0.0
    parts: dict[int, tuple[float, float]] = {}
    for share in shares:
        fields = share.split()
        if fields and fields[0] == b"p":
            for item in fields[1:]:
                j, n, t = item.split(b":")
                parts[int(j)] = (float(n), float(t))
        elif len(fields) == 2:
            numerator, tokens = numerator + float(fields[0]), tokens + float(fields[1])
        else:
            plain += float(fields[0])
    if parts:
        # inner: the values added first (one rank's micro-batches; or, per micro-batch, its k-th ones of every rank)
        inner = ([sorted(j for j in parts if j // data_parallel == k) for k in range(max(parts) // data_parallel + 1)]
                 if per_micro_batch else
                 [sorted(j for j in parts if j % data_parallel == d) for d in range(data_parallel)])
        total_n = total_t = 0.0
        for group in inner:
            group_n = group_t = 0.0
            for j in group:
                group_n, group_t = _f32(group_n + parts[j][0]), _f32(group_t + parts[j][1])
            total_n, total_t = _f32(total_n + group_n), _f32(total_t + group_t)
        plain += _f32(total_n / total_t) if total_t else 0.0
    return plain + (numerator / tokens if tokens else 0.0)


def _f32(x: float) -> float:
    """``x`` rounded to float32 (a sum or quotient of two float32 values, exact in float64, rounded once)."""
    return struct.unpack("f", struct.pack("f", x))[0]
