"""Value types and the error every ``odyssey`` subcommand uses for bad input.

A bad value is rejected while argparse reads it, so the message names the flag the user typed
(``argument --pp: must be a positive integer, got '-2'``) rather than a field deep inside. Errors
found after parsing (flags that contradict each other, unreadable files) are raised as
``UsageError`` (or the layers' ``PlanningError``/``SimulationError``) with the flag in the message;
``cli.main`` prints them as one line, ``odyssey SUB: error: ...``, and exits with code 2.
"""
from __future__ import annotations

import argparse
import math
import os


class UsageError(ValueError):
    """Bad command-line input found after parsing; the message names the flag."""


def _number(text: str, kind: type) -> float | int:
    try:
        value = kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = int(_number(text, int))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = float(_number(text, float))
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = float(_number(text, float))
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def ensure_folder(flag: str, path: str) -> None:
    """Create the output folder ``flag`` names now, so a bad one fails at once, not after the run."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a file; give a folder (it is created if missing)")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot create the folder ({exc.strerror or exc})") from None
    if not os.access(path, os.W_OK):
        raise UsageError(f"{flag} {path}: the folder is not writable")
