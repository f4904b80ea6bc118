"""Errors the planning layer raises for input it cannot plan with.

The CLI turns ``PlanningError`` into a one-line message and exit code 2, so every message must
name the offending value and what would be accepted instead.
"""
from __future__ import annotations

from pathlib import Path


class PlanningError(ValueError):
    """Bad cluster, profile, plan or failure set; the message says exactly what and why."""


def read_user_file(path: str | Path, source: str, expected: str, error: type[ValueError] = PlanningError) -> str:
    """The text of a file the user named, or ``error`` saying in one line why it cannot be read;
    ``source`` (the flag and path) starts the message and ``expected`` says what belongs there."""
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        raise error(f"{source}: file does not exist") from None
    except IsADirectoryError:
        raise error(f"{source}: is a folder, not {expected}") from None
    except UnicodeDecodeError:
        raise error(f"{source}: is not a text file (expected {expected})") from None
    except OSError as exc:
        raise error(f"{source}: cannot be read ({exc.strerror or exc})") from None
