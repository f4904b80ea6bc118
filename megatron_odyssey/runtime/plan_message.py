"""A generation's plan message as it crosses the store (the agent writes it once, every rank reads it)."""
from __future__ import annotations

import json
import zlib
from typing import Any, Mapping


def encode_plan_message(msg: dict[str, Any]) -> bytes:
    """zlib-compressed JSON. Every rank reads the whole message (it builds the plan's groups collectively), so
    its size crosses the store once per rank: 234 KB of JSON at 4096 ranks (about 1 GB through the store per
    recovery); compressed, a small fraction of that."""
    return zlib.compress(json.dumps(msg, separators=(",", ":")).encode(), 6)


def decode_plan_message(value: bytes) -> dict[str, Any]:
    """The message :func:`encode_plan_message` stored, or a plain JSON one (the agent's give-up)."""
    return json.loads(value if value[:1] == b"{" else zlib.decompress(value))


def checkpoint_due(step: int, interval: int, msg: Mapping[str, Any] | None) -> bool:
    """Whether a checkpoint follows ``step``: every ``interval`` steps, and after the first step of a generation
    whose plan the next failure can break (``save_on_entry`` in its message ``msg``; None in generation 0).
    The agent expects it and the ranks write it by this one rule."""
    on_entry = bool(msg and msg.get("save_on_entry")) and step == int(msg["resume_step"])  # type: ignore[index]
    return bool(interval) and ((step + 1) % interval == 0 or on_entry)
