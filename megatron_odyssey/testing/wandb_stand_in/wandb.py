"""A stand-in for Weights & Biases (``wandb``) on machines without its service: put this folder first on PYTHONPATH
and name a folder in $WANDB_STAND_IN_LOG. Each process appends what Megatron-LM asks of it (``init``, ``log``,
``finish``) to ``<pid>.jsonl`` there, with the time, so a test can read which rank logged which iteration to which
run, and when each run was opened and finished. ``finish`` takes $WANDB_STAND_IN_FINISH_S seconds (default 0), as a
real one takes the time to upload what it has not yet sent."""
import json
import os
import time
import uuid
from pathlib import Path


class _Config(dict):
    def update(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201 (wandb's own signature)
        super().update(*args, **kwargs)


config = _Config()
run = None


def _note(**record):  # noqa: ANN003
    with open(Path(os.environ["WANDB_STAND_IN_LOG"]) / f"{os.getpid()}.jsonl", "a") as out:
        out.write(json.dumps({**record, "t": time.time()}, default=str) + "\n")


class _Run:
    def __init__(self, id):  # noqa: A002, ANN001 (wandb's own name)
        self.id = id


def init(**kwargs):  # noqa: ANN003, ANN201
    """As wandb's: the run's id and resume mode come from the arguments, else from $WANDB_RUN_ID and $WANDB_RESUME,
    else a new id and no resuming."""
    global run
    run = _Run(kwargs.get("id") or os.environ.get("WANDB_RUN_ID") or uuid.uuid4().hex[:8])
    _note(call="init", name=kwargs.get("name"), project=kwargs.get("project"), rank=os.environ.get("RANK"),
          id=run.id, resume=kwargs.get("resume") or os.environ.get("WANDB_RESUME"))
    return run


def _number(value):  # noqa: ANN001, ANN202
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def log(data, step=None):  # noqa: ANN001, ANN201
    _note(call="log", data={k: _number(v) for k, v in data.items()}, step=step)


def finish():  # noqa: ANN201
    global run
    time.sleep(float(os.environ.get("WANDB_STAND_IN_FINISH_S", "0")))
    run = None
    _note(call="finish")


def define_metric(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201
    pass
