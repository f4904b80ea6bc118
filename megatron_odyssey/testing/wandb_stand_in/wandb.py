"""A stand-in for Weights & Biases (``wandb``) on machines without its service: put this folder first on PYTHONPATH
and name a folder in $WANDB_STAND_IN_LOG. Each process appends what Megatron-LM asks of it (``init``, ``log``,
``finish``) to ``<pid>.jsonl`` there, so a test can read which rank logged which iteration to which run."""
import json
import os
from pathlib import Path


class _Config(dict):
    def update(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201 (wandb's own signature)
        super().update(*args, **kwargs)


config = _Config()
run = None


def _note(**record):  # noqa: ANN003
    with open(Path(os.environ["WANDB_STAND_IN_LOG"]) / f"{os.getpid()}.jsonl", "a") as out:
        out.write(json.dumps(record, default=str) + "\n")


def init(**kwargs):  # noqa: ANN003, ANN201
    _note(call="init", name=kwargs.get("name"), project=kwargs.get("project"), rank=os.environ.get("RANK"))


def _number(value):  # noqa: ANN001, ANN202
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def log(data, step=None):  # noqa: ANN001, ANN201
    _note(call="log", data={k: _number(v) for k, v in data.items()}, step=step)


def finish():  # noqa: ANN201
    _note(call="finish")


def define_metric(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201
    pass
