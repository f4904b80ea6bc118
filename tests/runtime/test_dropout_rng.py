"""Dropout through failures (runtime.dropout_rng): masks keyed to (seed, step, global micro-batch, layer),
so a rerouted or re-placed micro-batch draws the masks it would have drawn on its original rank, and
training through a failure with dropout 0.1 equals the fault-free one-process reference."""
from __future__ import annotations

import json

import pytest
import torch

from megatron_odyssey.runtime.dropout_rng import key_seed

TOL = 1e-5
MODEL = dict(layers=4, hidden=32, heads=4, seq=16, global_batch=12, micro_batch=1, steps=4, seed=5,
             hidden_dropout=0.1, attention_dropout=0.1)


def test_seeds_are_a_function_of_what_is_computed() -> None:
    assert key_seed(1, 2, 3, 4, "default") == key_seed(1, 2, 3, 4, "default")
    seeds = {key_seed(1, s, j, layer, "default") for s in range(3) for j in range(4) for layer in range(-1, 4)}
    assert len(seeds) == 3 * 4 * 5 and all(0 <= x < 2 ** 63 for x in seeds)


def test_masks_do_not_depend_on_the_generator_state_before(gloo_world) -> None:
    """The same layer and micro-batch gives the same output whatever ran before it on this rank."""
    from megatron_odyssey.runtime import dropout_rng
    from megatron_odyssey.runtime.model import ModelConfig, build_stage_model, stage_forward

    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=8,
                      vocab_size=64, hidden_dropout=0.3, attention_dropout=0.3)
    model = build_stage_model(cfg, 0, 2)
    model.train()
    dropout_rng.install(model, seed=7, tp_rank=0)
    batch = {"tokens": torch.randint(0, 64, (1, 8)), "position_ids": torch.arange(8)[None],
             "labels": torch.randint(0, 64, (1, 8)), "loss_mask": torch.ones(1, 8),
             "attention_mask": torch.ones(1, 1, 8, 8, dtype=torch.bool).tril().logical_not()}
    outs = []
    for noise in (0, 1):
        torch.manual_seed(1000 + noise)  # another rank's stream state
        torch.rand(noise * 17 + 1)
        dropout_rng.set_micro_batch(3, 5)
        outs.append(stage_forward(model, batch))
    dropout_rng.set_micro_batch(3, 6)
    other = stage_forward(model, batch)
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], other)  # another micro-batch draws other masks


@pytest.fixture
def reference(fault_free_reference):
    from megatron_odyssey.runtime.config import TrainConfig

    return fault_free_reference(TrainConfig(nproc=1, tp=1, pp=1, **MODEL))


@pytest.mark.parametrize("policy", ["reroute", "reconfigure"])
def test_dropout_through_a_failure_equals_fault_free_training(reference, fault_free_reference, tmp_path,
                                                             policy) -> None:
    from megatron_odyssey.runtime.config import TrainConfig
    from megatron_odyssey.standalone.launcher import launch

    cfg = TrainConfig(nproc=6, tp=1, pp=2, fail=["step=1,rank=4,phase=backward,kind=kill"], policy=policy,
                      save_params=str(tmp_path / "p.pt"), report=str(tmp_path / "report.json"), **MODEL)
    launch(cfg, tmp_path / "run", quiet=True)
    params, report = torch.load(tmp_path / "p.pt"), json.loads((tmp_path / "report.json").read_text())
    assert [f["policy"] for f in report["failures"]] == [policy]
    worst = max((params[k] - reference["params"][k]).abs().max().item() for k in params)
    assert worst < TOL, worst
    assert [s["loss"] for s in report["steps"]] == pytest.approx(reference["losses"], abs=TOL)
    # dropout is really on: the reference's losses differ from a run without it
    no_dropout = TrainConfig(nproc=1, tp=1, pp=1, **{**MODEL, "hidden_dropout": 0.0, "attention_dropout": 0.0,
                                                     "steps": 1})
    assert reference["losses"][0] != pytest.approx(fault_free_reference(no_dropout)["losses"][0], abs=1e-4)
