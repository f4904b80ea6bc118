"""Deterministic micro-batch addressing on megatron's GPTDataset, and the demo indexed dataset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_odyssey.runtime import data as D


def test_sample_indices_formula() -> None:
    assert list(D.sample_indices(0, 0, 8, 2)) == [0, 1]
    assert list(D.sample_indices(3, 2, 8, 2)) == [28, 29]  # 3*8 + 2*2
    step = [i for j in range(4) for i in D.sample_indices(5, j, 8, 2)]
    assert step == list(range(40, 48))  # a step's micro-batches tile its global batch
    with pytest.raises(IndexError):
        D.sample_indices(0, 4, 8, 2)
    with pytest.raises(ValueError):
        D.DataConfig(micro_batch_size=3, global_batch_size=8)


def test_byte_tokenizer_round_trip() -> None:
    tok = D.ByteTokenizer()
    ids = tok.tokenize("Tide, café.")
    assert max(ids) < 256 and tok.detokenize(ids + [tok.eod]) == "Tide, café."
    assert tok.vocab_size == 258 and tok.eod == 256 and tok.pad == 257 and len(tok.vocab) == 258


def test_demo_corpus_is_shipped() -> None:
    size = D.DEMO_CORPUS_PATH.stat().st_size
    assert 100_000 <= size <= 200_000
    assert len(D.read_documents()) > 100


def test_indexed_dataset_reads_back_corpus(tmp_path: Path) -> None:
    prefix = D.main(["--output-prefix", str(tmp_path / "demo" / "corpus")])
    assert Path(prefix + ".bin").is_file() and Path(prefix + ".idx").is_file()
    docs = D.read_indexed_dataset(prefix)
    text_docs = D.read_documents()
    tok = D.ByteTokenizer()
    assert len(docs) == len(text_docs)
    for stored, text in zip(docs, text_docs):
        assert stored.dtype == np.uint16
        assert stored.tolist() == tok.tokenize(text) + [tok.eod]
    assert tok.detokenize(docs[1].tolist()) == text_docs[1]


def test_gpt_dataset_over_demo_corpus(tmp_path: Path) -> None:
    prefix = D.build_indexed_dataset(tmp_path / "demo")
    cfg = D.DataConfig(data_path=prefix, path_to_cache=str(tmp_path / "cache"), create_attention_mask=True)
    data = D.MicroBatchData(cfg)
    mb = data.micro_batch(2, 3)
    b, s = cfg.micro_batch_size, cfg.seq_length
    assert mb["tokens"].shape == mb["labels"].shape == mb["position_ids"].shape == (b, s)
    assert mb["attention_mask"].shape == (b, 1, s, s) and mb["attention_mask"].dtype == torch.bool
    assert torch.equal(mb["tokens"][:, 1:], mb["labels"][:, :-1])  # labels are next tokens
    assert int(mb["tokens"].max()) < D.ByteTokenizer.VOCAB_SIZE
    # Samples are real corpus text: decoded, each is a substring of some document stream.
    corpus = "\n".join(D.read_documents())
    piece = D.ByteTokenizer().detokenize(mb["tokens"][0].tolist())
    assert any(len(part) < 6 or part in corpus for part in piece.split("\ufffd"))
    assert list(Path(tmp_path / "cache").glob("*GPTDataset-train-shuffle_index.npy"))


def test_same_micro_batch_from_independent_builds() -> None:
    """Two independently built MockGPTDatasets (as two ranks would) agree on every address,
    whatever order the addresses are asked in; different addresses differ."""
    cfg = D.DataConfig()
    a, b = D.MicroBatchData(cfg), D.MicroBatchData(cfg)
    addrs = [(t, j) for t in (0, 3, 99) for j in range(cfg.num_micro_batches)]
    first = {addr: a.micro_batch(*addr) for addr in addrs}
    for addr in reversed(addrs):
        other = b.micro_batch(*addr)
        for key in first[addr]:
            assert torch.equal(first[addr][key], other[key]), (addr, key)
    assert not torch.equal(first[(0, 0)]["tokens"], first[(0, 1)]["tokens"])
    assert not torch.equal(first[(0, 0)]["tokens"], first[(3, 0)]["tokens"])
    # the mock dataset is megatron's
    from megatron.core.datasets.gpt_dataset import MockGPTDataset

    assert isinstance(a.dataset, MockGPTDataset)


def test_the_lab_mock_is_megatrons_first_documents_cut_and_shuffled_by_megatron() -> None:
    """LabMockGPTDataset: megatron's own mock documents (the first MOCK_DOCUMENTS of them, same lengths and
    tokens) through megatron's GPTDataset, so a job reads the samples megatron would cut from them; a train
    split smaller than the job's samples repeats as megatron's epochs do."""
    from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset

    tokenizer = D.ByteTokenizer()
    ours, megatrons = D.FewerMockDocuments(tokenizer), MockGPTLowLevelDataset(tokenizer)
    assert len(ours) == D.MOCK_DOCUMENTS < len(megatrons)
    assert (ours.sequence_lengths == megatrons.sequence_lengths[:D.MOCK_DOCUMENTS]).all()
    assert all((ours[i] == megatrons[i]).all() for i in (0, 1, D.MOCK_DOCUMENTS - 1))
    cfg = D.DataConfig(seq_length=2048, micro_batch_size=1, global_batch_size=8, train_steps=1000)
    dataset = D.build_train_dataset(cfg)
    assert len(dataset) >= cfg.num_samples  # megatron repeats the 1,000 train documents' epochs to cover them
    assert dataset.document_index.size > D.MOCK_DOCUMENTS // 3


def test_same_micro_batch_from_any_rank(two_rank_results: dict) -> None:
    """Two gloo ranks build mock and real datasets (real: rank 0 writes the index cache) and ask
    the same addresses in opposite orders: identical micro-batches."""
    rank0, rank1 = two_rank_results["data"]
    for kind in ("mock", "real"):
        assert set(rank0[kind]) == set(rank1[kind]) and len(rank0[kind]) == 12
        for addr, mb in rank0[kind].items():
            for key, t in mb.items():
                assert torch.equal(t, rank1[kind][addr][key]), (kind, addr, key)
