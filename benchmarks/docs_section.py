"""Every benchmark owns one section of docs/benchmarks.md, between its own HTML-comment markers."""
from __future__ import annotations

from pathlib import Path

HEADER = "# Benchmarks\n\nEvery figure below comes with the command that produced it and the machine it ran on.\n"


def write_section(path: Path, section: str, start: str, end: str) -> None:
    """Replace the text between ``start`` and ``end`` (markers included in ``section``), or append it."""
    text = path.read_text() if path.exists() else HEADER
    if start in text and end in text:
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = head + section + tail
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
