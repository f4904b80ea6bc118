"""What the Megatron-LM benchmarks share: the checkout they run, and their rounds of jobs."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable


def megatron_lm_checkout() -> str:
    """``MEGATRON_LM_PATH``, or exit saying it is needed."""
    mlm = os.environ.get("MEGATRON_LM_PATH")
    if not mlm or not (Path(mlm) / "pretrain_gpt.py").exists():
        sys.exit("set MEGATRON_LM_PATH to a Megatron-LM checkout")
    return mlm


def run_rounds(repeats: int, one_round: Callable[[str, Path, int], Any], base_port: int) -> list[Any]:
    """``one_round(checkout, workdir, port)`` ``repeats`` times, each in a fresh directory on its own ports."""
    mlm = megatron_lm_checkout()
    out = []
    for i in range(repeats):
        with tempfile.TemporaryDirectory() as d:
            out.append(one_round(mlm, Path(d), base_port + 100 * i + os.getpid() % 50))
        print(f"round {i + 1}/{repeats}: {out[-1]}", flush=True)
    return out
