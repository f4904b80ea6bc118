"""The fault-free reference is run once per session and shared by the jobs it describes: its key must name
every setting the run reads, or two jobs with different models would be compared with one run."""
from __future__ import annotations

import dataclasses
import inspect
import re

from megatron_odyssey.runtime.config import TrainConfig
from megatron_odyssey.testing.reference import REFERENCE_FIELDS, reference_key, run_reference

BASE = TrainConfig(nproc=1, tp=1, pp=1, layers=4, hidden=32, heads=4, seq=16, global_batch=8, steps=2, seed=3)


def _changed(name: str, value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2 + 1
    if isinstance(value, list):
        return value + ["step=1,rank=0,kind=kill"]
    if isinstance(value, dict):
        return {**value, "changed": True}
    return f"/elsewhere/{name}" if name != "ffn_hidden" else 96  # None or a path


def test_only_the_reference_fields_change_the_run_and_its_key():
    for field in dataclasses.fields(TrainConfig):
        other = dataclasses.replace(BASE, **{field.name: _changed(field.name, getattr(BASE, field.name))})
        if field.name in REFERENCE_FIELDS:
            assert reference_key(other) != reference_key(BASE), field.name
        else:
            assert reference_key(other) == reference_key(BASE), field.name
            assert other.model_config() == BASE.model_config(), field.name
            assert other.data_config() == BASE.data_config(), field.name


def test_the_reference_run_reads_no_setting_outside_its_key():
    derived = {"model_config", "data_config", "dropout"}  # checked above, or made of hidden/attention_dropout
    read = set(re.findall(r"\bcfg\.(\w+)", inspect.getsource(run_reference))) - derived
    assert read and read <= set(REFERENCE_FIELDS), read - set(REFERENCE_FIELDS)
