"""Evaluation after a failure (megatron_lm.evaluation): the loss dictionaries handed to Megatron's ``evaluate``
add up, bit for bit, to what stock's data-parallel ranks compute with real gloo all-reduces."""
from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from megatron_odyssey.megatron_lm.evaluation import EvalSplits, stock_loss_dicts


def _stock_ranks(rank: int, world: int, store: str, pairs: torch.Tensor, per_micro_batch: bool, out: str) -> None:
    """Data-parallel rank ``rank`` of stock Megatron-LM: its micro-batches are rows rank, rank + world, ...; the
    reduction is evaluate()'s (core_r0.13+: stack, sum, all-reduce) or core_r0.12's (loss_func all-reduces each
    micro-batch's pair, evaluate adds them one by one into an fp32 total)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mine = [pairs[j].clone() for j in range(rank, pairs.shape[0], world)]
    total = torch.tensor([0.0, 0.0], dtype=torch.float)
    if per_micro_batch:
        for pair in mine:
            dist.all_reduce(pair)
            total[0] += pair[0]
            total[1] += pair[1]
    else:
        val = torch.vstack(mine).sum(dim=0)
        dist.all_reduce(val)
        total += val
    if rank == 0:
        torch.save(total, out)
    dist.destroy_process_group()


def _ours(pairs: torch.Tensor, world: int, per_micro_batch: bool) -> torch.Tensor:
    """stock_loss_dicts' answer put through evaluate()'s own arithmetic on a data-parallel world of one."""
    total = torch.tensor([0.0, 0.0], dtype=torch.float)
    dicts = stock_loss_dicts(pairs, world, per_micro_batch)
    if per_micro_batch:
        for d in dicts:
            total[0] += d["lm loss"][0]
            total[1] += d["lm loss"][1]
    else:
        total += torch.vstack([d["lm loss"].view(-1) for d in dicts]).sum(dim=0)
    return total


@pytest.mark.parametrize("per_micro_batch", [False, True], ids=["core_r0.13+", "core_r0.12"])
def test_loss_dicts_add_up_to_stocks_reduction_over_two_ranks(tmp_path, per_micro_batch: bool) -> None:
    # losses whose fp32 sum depends on which rank adds which (1 is lost next to 1e8): rank 0 holds rows 0, 2, 4, 6
    losses = torch.tensor([1e8, 1.0, -1e8, 1.0, 3.0, 1e8, 0.25, -1e8])
    pairs = torch.stack([losses, torch.tensor([32.0, 31.0, 32.0, 7.0, 1.0, 32.0, 5.0, 32.0])], dim=1)
    out = tmp_path / "stock.pt"
    mp.spawn(_stock_ranks, args=(2, str(tmp_path / "store"), pairs, per_micro_batch, str(out)), nprocs=2, join=True)
    stock = torch.load(out)
    assert torch.equal(_ours(pairs, 2, per_micro_batch), stock)
    # and the order matters here: adding the rows in the ranks' blocks instead gives another number
    blocks = sum(pairs[r * 4:(r + 1) * 4].sum(dim=0) for r in range(2))
    assert not torch.equal(blocks, stock)


def test_pairs_belong_to_ranks_by_global_micro_batch() -> None:
    """Row j is data-parallel rank j % DP's (j // DP)-th micro-batch (samples.GlobalMicroBatches' numbering)."""
    pairs = torch.tensor([[1.0, 1.0], [10.0, 1.0], [100.0, 1.0], [1000.0, 1.0], [1e4, 1.0], [1e5, 1.0]])
    per_pair = stock_loss_dicts(pairs, 2, per_micro_batch=True)
    assert [float(d["lm loss"][0]) for d in per_pair] == [11.0, 1100.0, 110000.0]
    (total,) = stock_loss_dicts(pairs, 3, per_micro_batch=False)
    assert total["lm loss"].tolist() == [111111.0, 6.0]
    with pytest.raises(ValueError, match="5 micro-batches do not split over 2"):
        stock_loss_dicts(pairs[:5], 2, per_micro_batch=False)


def test_an_unknown_iterator_is_refused_and_the_test_split_keeps_its_own_position() -> None:
    splits = EvalSplits()
    valid, test = iter([]), iter([])
    splits.record([valid], "valid")
    splits.record(test, "test")
    assert splits.kind_of(valid) == "valid" and splits.kind_of([test]) == "test"
    with pytest.raises(RuntimeError, match="only over the validation and test iterators"):
        splits.kind_of(iter([]))

    class Args:
        consumed_valid_samples = 48

    splits.current, splits.valid_at_start, splits.test_consumed = "test", 40, 16
    assert splits.position(Args()) == 24  # 16 before this evaluation, 8 in it
    splits.current = "valid"
    assert splits.position(Args()) == 48
