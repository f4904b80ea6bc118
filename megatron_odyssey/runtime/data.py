"""Deterministically addressed training data on megatron-core's dataset stack.

Rerouting runs a failed node's micro-batches on its peers, and reconfiguration changes which
rank computes which micro-batch; both only preserve the training trajectory if a micro-batch is
a pure function of ``(step, global micro-batch index)``, never of the rank or of an iterator's
position. :class:`MicroBatchData` gives exactly that on top of megatron-core's ``GPTDataset``
(built through ``BlendedMegatronDatasetBuilder``/``GPTDatasetConfig``; megatron's ``MockGPTDataset``,
over fewer documents, when no data path is given)::

    samples(step t, micro-batch j) = t * global_batch + j * micro_batch + range(micro_batch)

It also builds a small *real* Megatron indexed dataset (``.bin``/``.idx``) from the shipped demo
corpus with a byte-level tokenizer that needs no files or network:
``python -m megatron_odyssey.runtime.data --output-prefix /tmp/demo``.

megatron's C++ index helpers (``megatron.core.datasets.helpers_cpp``, used by
``GPTDataset`` to build the sample index) ship precompiled in the megatron-core 0.16.1
manylinux wheel, so no ``make`` step is needed after ``pip install``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Union

import numpy as np
import torch

try:
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import (
        GPTDataset,
        GPTDatasetConfig,
        MockGPTDataset,
        MockGPTLowLevelDataset,
    )
    from megatron.core.datasets.indexed_dataset import (
        DType,
        IndexedDataset,
        IndexedDatasetBuilder,
        get_bin_path,
        get_idx_path,
    )
    from megatron.core.tokenizers import MegatronTokenizerBase
except ImportError as _exc:  # pragma: no cover - exercised only without megatron-core
    raise ImportError(
        "megatron_odyssey.runtime.data needs megatron-core: pip install 'megatron-odyssey[runtime]'"
    ) from _exc

logger = logging.getLogger(__name__)

#: The demo corpus shipped with the package (original text, public domain).
DEMO_CORPUS_PATH: Path = Path(__file__).resolve().parent.parent / "data" / "demo_corpus.txt"


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


class ByteTokenizer(MegatronTokenizerBase):
    """Byte-level tokenizer: token id = UTF-8 byte value (0-255), then EOD (256) and PAD (257).

    Needs no vocabulary file and no network (megatron's own tokenizer classes download or read
    model files). Implements what megatron's datasets use: ``vocab_size``, ``eod``, ``pad`` and
    ``unique_identifiers`` (hashed into the dataset cache key).
    """

    EOD: int = 256
    PAD: int = 257
    VOCAB_SIZE: int = 258

    def __init__(self) -> None:
        super().__init__(path="", config={})
        self.unique_identifiers = OrderedDict([("class", type(self).__name__), ("vocab_size", self.VOCAB_SIZE)])

    def tokenize(self, text: str) -> List[int]:  # type: ignore[override]
        """UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int]) -> str:  # type: ignore[override]
        """Text from ids; special tokens are dropped, invalid UTF-8 replaced."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    @property
    def vocab(self) -> Dict[str, int]:  # type: ignore[override]
        """Token string -> id (bytes as ``<0xNN>``)."""
        v = {f"<0x{i:02X}>": i for i in range(256)}
        v["<eod>"] = self.EOD
        v["<pad>"] = self.PAD
        return v

    @property
    def vocab_size(self) -> int:  # type: ignore[override]
        """Number of token ids (258); the model's vocabulary may be padded beyond it."""
        return self.VOCAB_SIZE

    @property
    def eod(self) -> int:
        """End-of-document id, appended after every document."""
        return self.EOD

    @property
    def pad(self) -> int:
        """Padding id; megatron masks the loss where labels are padding."""
        return self.PAD

    def apply_chat_template(self, *args: object, **kwargs: object) -> None:  # type: ignore[override]
        """Not a chat tokenizer."""
        raise NotImplementedError("ByteTokenizer has no chat template")


# --------------------------------------------------------------------------------------------
# Indexed dataset from a text file
# --------------------------------------------------------------------------------------------


def read_documents(text_path: Union[str, Path] = DEMO_CORPUS_PATH) -> List[str]:
    """Split a text file into documents at blank lines (one paragraph = one document)."""
    text = Path(text_path).read_text(encoding="utf-8")
    return [d.strip() for d in re.split(r"\n\s*\n", text) if d.strip()]


def build_indexed_dataset(
    output_prefix: Union[str, Path],
    text_path: Union[str, Path] = DEMO_CORPUS_PATH,
    tokenizer: Optional[ByteTokenizer] = None,
    append_eod: bool = True,
) -> str:
    """Tokenize ``text_path`` into a Megatron indexed dataset ``<prefix>.bin``/``<prefix>.idx``.

    One document per paragraph, EOD appended (as Megatron-LM's ``preprocess_data.py
    --append-eod``), tokens stored as uint16 (megatron's ``DType.optimal_dtype`` for the
    vocabulary). Returns the prefix to pass as ``DataConfig.data_path``.
    """
    tokenizer = tokenizer or ByteTokenizer()
    prefix = str(output_prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=DType.optimal_dtype(tokenizer.vocab_size))
    for doc in read_documents(text_path):
        ids = tokenizer.tokenize(doc)
        if append_eod:
            ids.append(tokenizer.eod)
        builder.add_document(np.asarray(ids, dtype=np.int64), [len(ids)])  # type: ignore[arg-type]
    builder.finalize(get_idx_path(prefix))
    return prefix


def read_indexed_dataset(prefix: Union[str, Path]) -> List[np.ndarray]:
    """All documents of an indexed dataset, as token arrays (for checks and inspection)."""
    ds = IndexedDataset(str(prefix), mmap=True)
    # Copy: the arrays are views of an mmap that closes with `ds`.
    return [np.array(ds[i], copy=True) for i in range(len(ds))]


# --------------------------------------------------------------------------------------------
# Deterministic micro-batches
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataConfig:
    """What to read and how batches are cut.

    ``data_path``: prefix of a Megatron indexed dataset (``.bin``/``.idx``), or None for
    megatron's ``MockGPTDataset`` (:class:`LabMockGPTDataset`). ``train_samples`` defaults to
    ``train_steps * global_batch_size``; indices past the dataset's end wrap around. ``create_attention_mask``
    adds megatron's boolean ``[b, 1, s, s]`` mask (True = masked); off by default since the model builds the
    causal mask.
    """

    seq_length: int = 32
    micro_batch_size: int = 2
    global_batch_size: int = 8
    train_steps: int = 100
    seed: int = 1234
    data_path: Optional[str] = None
    path_to_cache: Optional[str] = None
    train_samples: Optional[int] = None
    eod_mask_loss: bool = False
    create_attention_mask: bool = False

    def __post_init__(self) -> None:
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError("global_batch_size must be a multiple of micro_batch_size")

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per global batch (over all data-parallel replicas together)."""
        return self.global_batch_size // self.micro_batch_size

    @property
    def num_samples(self) -> int:
        """Samples the training split must provide."""
        return self.train_samples if self.train_samples is not None else self.train_steps * self.global_batch_size


def sample_indices(step: int, global_mb_index: int, global_batch_size: int, micro_batch_size: int) -> range:
    """Dataset indices of micro-batch ``global_mb_index`` of step ``step`` (rank-independent)."""
    if not 0 <= global_mb_index < global_batch_size // micro_batch_size:
        raise IndexError(f"micro-batch {global_mb_index} outside [0, {global_batch_size // micro_batch_size})")
    if step < 0:
        raise IndexError("step must be >= 0")
    start = step * global_batch_size + global_mb_index * micro_batch_size
    return range(start, start + micro_batch_size)


def gpt_dataset_config(cfg: DataConfig, tokenizer: MegatronTokenizerBase) -> GPTDatasetConfig:
    """megatron ``GPTDatasetConfig`` for ``cfg`` (all samples in the train split)."""
    blend = ([cfg.data_path], None) if cfg.data_path is not None else None
    return GPTDatasetConfig(
        random_seed=cfg.seed,
        sequence_length=cfg.seq_length,
        blend=blend,
        split="100,0,0" if blend is not None else None,
        path_to_cache=cfg.path_to_cache,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=cfg.eod_mask_loss,
        create_attention_mask=cfg.create_attention_mask,
    )


#: Mock documents (a third of them in the train split); megatron's own mock has 100,000.
MOCK_DOCUMENTS = 3000


class FewerMockDocuments(MockGPTLowLevelDataset):
    """megatron's mock documents (same seed, same length distribution), fewer of them."""

    size = MOCK_DOCUMENTS


class LabMockGPTDataset(MockGPTDataset):
    """megatron's ``MockGPTDataset`` over :data:`MOCK_DOCUMENTS` mock documents.

    Why: megatron's 100,000 documents of up to 4,096 tokens make 4.3 M samples of 16 tokens in the train split,
    and ``GPTDataset`` shuffles the whole epoch in every process that builds it: 2 s of CPU per rank and per
    reference run at start-up, most of a lab job's CPU, for the few dozen samples it reads. Samples are still cut,
    shuffled and repeated epoch after epoch by megatron's ``GPTDataset``; only the document list is shorter.
    """

    @staticmethod
    def build_low_level_dataset(dataset_path: Optional[str], config: GPTDatasetConfig) -> MockGPTLowLevelDataset:
        return FewerMockDocuments(config.tokenizer)


def build_train_dataset(cfg: DataConfig, tokenizer: Optional[MegatronTokenizerBase] = None) -> GPTDataset:
    """The training ``GPTDataset`` (:class:`LabMockGPTDataset` without ``data_path``) via megatron's builder.

    When ``torch.distributed`` is initialised megatron's builder builds on rank 0 first and puts
    barriers on the *world* group, so every rank must call this together, at start-up (before
    any failure). Our ranks call it before joining any group, so megatron would let every one of
    them write the same index cache at once (one then reads another's half-written ``.npy``:
    ``EOFError: No data left in file``); :func:`cache_lock` makes the first process on the machine
    build it while the others wait, then load the finished files.
    """
    tokenizer = tokenizer or ByteTokenizer()
    cls = GPTDataset if cfg.data_path is not None else LabMockGPTDataset
    # Mock mode forces megatron's split "1,1,1"; ask the other two splits for one sample only.
    sizes = [cfg.num_samples, None, None] if cfg.data_path is not None else [cfg.num_samples, 1, 1]
    with cache_lock(cfg):
        train, _, _ = BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, gpt_dataset_config(cfg, tokenizer)).build()
    if train is None or len(train) == 0:
        raise RuntimeError("megatron built an empty training dataset")
    disable_mask_cache(train)
    return train


def cache_dir(cfg: DataConfig) -> Optional[str]:
    """Where megatron's ``GPTDataset`` keeps its index cache (None: mock data, nothing cached)."""
    if cfg.path_to_cache is not None:
        return cfg.path_to_cache
    return os.path.join(cfg.data_path, "cache") if cfg.data_path is not None else None


@contextlib.contextmanager
def cache_lock(cfg: DataConfig) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the cache directory while building: one process per machine
    builds the cache, the others wait and then find it complete (a cache hit). The lock goes with the
    process, so a builder that dies releases it. Not taken when ``torch.distributed`` is initialised:
    megatron's builder then orders the ranks itself (rank 0 builds, the others wait at a world
    barrier *inside* the build), and a lock held across that barrier would deadlock."""
    folder = cache_dir(cfg)
    if folder is None or torch.distributed.is_initialized():
        yield
        return
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, ".odyssey-build.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def disable_mask_cache(dataset: object) -> None:
    """Turn off ``GPTDataset``'s mask/position cache (works around a megatron-core 0.16.1 bug).

    ``GPTDataset.__getitem__`` caches the loss mask of the *first* sample it serves and then
    zeroes that same tensor where the sample's labels are padding, so the padding of whichever
    sample a process happened to read first leaks into every later sample's ``loss_mask``:
    micro-batches would depend on access order, i.e. on the rank. Recomputing the masks per
    sample is cheap. Recurses into ``BlendedDataset.datasets``.
    """
    if hasattr(dataset, "masks_and_position_ids_are_cacheable"):
        dataset.masks_and_position_ids_are_cacheable = False  # type: ignore[attr-defined]
        dataset.masks_and_position_ids_are_cached = False  # type: ignore[attr-defined]
    for child in getattr(dataset, "datasets", None) or []:
        disable_mask_cache(child)


_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")


class MicroBatchData:
    """Micro-batches addressed by ``(step, global micro-batch index)``.

    Every rank that builds this with the same :class:`DataConfig` gets bit-identical
    micro-batches for the same address, so any rank can compute any micro-batch: rerouted
    micro-batches of a failed peer, or a new split after reconfiguration.
    """

    def __init__(
        self,
        cfg: DataConfig,
        dataset: Optional[torch.utils.data.Dataset] = None,
        tokenizer: Optional[MegatronTokenizerBase] = None,
    ) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer or ByteTokenizer()
        self.dataset = dataset if dataset is not None else build_train_dataset(cfg, self.tokenizer)
        disable_mask_cache(self.dataset)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per step."""
        return self.cfg.num_micro_batches

    def sample_indices(self, step: int, global_mb_index: int) -> List[int]:
        """Dataset indices of a micro-batch, wrapped at the dataset's end."""
        n = len(self.dataset)
        return [
            i % n
            for i in sample_indices(step, global_mb_index, self.cfg.global_batch_size, self.cfg.micro_batch_size)
        ]

    def micro_batch(self, step: int, global_mb_index: int) -> Dict[str, torch.Tensor]:
        """``tokens``/``labels``/``position_ids`` (int64 ``[b, s]``), ``loss_mask`` (fp32 ``[b, s]``)
        and, when configured, ``attention_mask`` (bool ``[b, 1, s, s]``)."""
        samples = [self.dataset[i] for i in self.sample_indices(step, global_mb_index)]
        return {k: torch.stack([s[k] for s in samples]) for k in _KEYS if k in samples[0]}

    def global_batch(self, step: int) -> List[Dict[str, torch.Tensor]]:
        """All micro-batches of a step, in global micro-batch order."""
        return [self.micro_batch(step, j) for j in range(self.num_micro_batches)]


# --------------------------------------------------------------------------------------------
# Script entry point
# --------------------------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> str:
    """``python -m megatron_odyssey.runtime.data --output-prefix PREFIX [--input TEXT]``."""
    parser = argparse.ArgumentParser(description="Build a Megatron indexed dataset (.bin/.idx) with a byte tokenizer")
    parser.add_argument("--input", default=str(DEMO_CORPUS_PATH), help="text file; paragraphs become documents")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--no-eod", action="store_true", help="do not append EOD to each document")
    args = parser.parse_args(argv)
    prefix = build_indexed_dataset(args.output_prefix, args.input, append_eod=not args.no_eod)
    n_docs = len(read_documents(args.input))
    print(f"wrote {get_bin_path(prefix)} and {get_idx_path(prefix)} ({n_docs} documents)")
    return prefix


if __name__ == "__main__":  # pragma: no cover
    main()
