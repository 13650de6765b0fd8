"""Whole documents as variable-length training sequences, in a seeded, resumable order (ChunkFlow's input).

``PackedDataset`` cuts a split's document stream into fixed windows; a :class:`SequenceDataset` instead hands
out each document whole, so a consumer (ChunkFlow's chunk construction, ``megasparse/chunkflow/``) decides how
to pack short ones and split long ones. Same split as packing (:func:`~megasparse.data.dataset.split_documents`:
a document is in train or valid for both), lengths from the ``.idx`` alone (Megatron's index stores them), and
the same EOD rule: a document's stored EOD is kept, one is appended where the data lacks it.

Sequence ``i`` is the ``i``-th non-empty document of the split in file order (a document that tokenized to
nothing has no tokens to learn from and is skipped). A sequence of ``n`` tokens gives ``n - 1`` next-token
predictions (inputs ``[:-1]``, labels ``[1:]``), the last one its EOD.

Too long. With ``max_length`` set, a document longer than that is truncated to its first ``max_length``
tokens (no EOD appended: the document did not end there), counted in ``num_truncated`` /
``truncated_tokens`` and in the length report; ``truncate=False`` makes it a one-line ``DataError`` instead
(decision 1210).

Order. Global sequence ``g`` is sequence ``epoch_order(e)[k]`` for ``(e, k) = divmod(g, len)``, a permutation
seeded by ``(seed, e)``; the validation split is read in file order. Optimizer step ``t`` of a run drawing
``n`` sequences per step reads global sequences ``t*n ... t*n + n - 1`` (:meth:`SequenceDataset.step_sequences`),
the same on every rank, so resuming at any step reads exactly what the uninterrupted run read.
"""

from __future__ import annotations

import numpy as np

from megasparse.configbase import ConfigError
from megasparse.data.config import DataConfig
from megasparse.data.indexed import DataError, IndexedDataset

__all__ = ["SequenceDataset", "build_sequence_datasets", "sequence_splits"]


class SequenceDataset:
    """One split's non-empty documents as whole sequences (see the module docstring)."""

    def __init__(
        self,
        indexed: IndexedDataset,
        doc_ids: np.ndarray,
        eod_id: int,
        max_length: int | None = None,
        seed: int = 1234,
        shuffle: bool = True,
        name: str = "train",
        truncate: bool = True,
    ) -> None:
        if max_length is not None and max_length < 2:
            raise ConfigError(f"sequence max_length={max_length} must be >= 2 (one prediction needs two tokens)")
        self.indexed, self.eod_id, self.max_length = indexed, eod_id, max_length
        self.seed, self.shuffle, self.name = seed, shuffle, name
        doc_ids = np.asarray(doc_ids, dtype=np.int64)
        self.doc_ids = doc_ids[indexed.doc_lengths[doc_ids] > 0]
        self._starts = indexed.doc_starts[self.doc_ids]
        stored = indexed.doc_lengths[self.doc_ids].astype(np.int64)
        ends_eod = np.zeros(len(self.doc_ids), dtype=bool)
        if len(self.doc_ids):
            ends_eod = np.asarray(indexed.tokens[self._starts + stored - 1]) == eod_id
        self._add_eod = ~ends_eod
        full = stored + self._add_eod  # the whole document with its EOD
        self.full_lengths = full
        """Token counts before truncation (EOD included)."""
        self.lengths = full if max_length is None else np.minimum(full, max_length)
        """Token counts of :meth:`sequence` (EOD included; truncated ones without)."""
        self.num_truncated = int((full > self.lengths).sum())
        self.truncated_tokens = int((full - self.lengths).sum())
        if self.num_truncated and not truncate:
            i = int(np.argmax(full > self.lengths))
            raise DataError(
                f"{indexed.prefix}: document {int(self.doc_ids[i])} of the {name} split has {int(full[i])} tokens, "
                f"more than the maximum sequence length {max_length} ({self.num_truncated} such documents); "
                "raise the maximum or allow truncation"
            )
        self.num_tokens = int(self.lengths.sum())
        self._order_cache: tuple[int, int, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.doc_ids)

    def positions(self, i: int) -> np.ndarray:
        """``.bin`` offsets of sequence ``i``'s tokens (-1: the EOD appended here), for per-token side data."""
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} out of range for the {self.name} split of {len(self)} sequences")
        n, s = int(self.lengths[i]), int(self._starts[i])
        real = n - int(self._add_eod[i] and n == self.full_lengths[i])
        out = np.full(n, -1, dtype=np.int64)
        out[:real] = np.arange(s, s + real)
        return out

    def sequence(self, i: int) -> np.ndarray:
        """Sequence ``i``'s tokens (int64): the document with its EOD, or its first ``max_length`` tokens."""
        pos = self.positions(i)
        toks = np.full(len(pos), self.eod_id, dtype=np.int64)
        real = pos >= 0
        toks[real] = self.indexed.tokens[pos[real]]
        return toks

    def __getitem__(self, i: int) -> np.ndarray:
        return self.sequence(int(i))

    def epoch_order(self, epoch: int, seed: int | None = None) -> np.ndarray:
        """Sequence ids in the order epoch ``epoch`` reads them (file order for an unshuffled split)."""
        seed = self.seed if seed is None else seed
        if not self.shuffle:
            return np.arange(len(self))
        if self._order_cache is None or self._order_cache[:2] != (seed, epoch):
            order = np.random.default_rng([seed, epoch, 0x5E9]).permutation(len(self))
            self._order_cache = (seed, epoch, order)
        return self._order_cache[2]

    def global_index(self, g: int, seed: int | None = None) -> int:
        """Sequence id of the ``g``-th sequence of the endless epoch-by-epoch stream."""
        if len(self) == 0:
            raise DataError(f"{self.indexed.prefix}: the {self.name} split has no non-empty documents")
        if g < 0:
            raise IndexError(f"global sequence {g} is negative")
        epoch, k = divmod(g, len(self))
        return int(self.epoch_order(epoch, seed)[k])

    def global_positions(self, g: int, seed: int | None = None) -> np.ndarray:
        """``.bin`` offsets of the ``g``-th sequence's tokens (:meth:`positions`): where a sidecar's losses sit."""
        return self.positions(self.global_index(g, seed))

    def global_sequence(self, g: int, seed: int | None = None) -> np.ndarray:
        """Tokens of the ``g``-th sequence of the endless stream."""
        return self.sequence(self.global_index(g, seed))

    def predictions_before(self, g: int, seed: int | None = None) -> int:
        """Next-token predictions (tokens - 1 per sequence) of global sequences ``0 ... g - 1``: the tokens a run
        has trained when it resumes at global sequence ``g`` (whole epochs from the split's total, the partial one
        from its order), from the index alone."""
        if g <= 0 or len(self) == 0:
            return 0
        preds = np.maximum(self.lengths - 1, 0)
        epochs, rest = divmod(g, len(self))
        partial = int(preds[self.epoch_order(epochs, seed)[:rest]].sum()) if rest else 0
        return epochs * int(preds.sum()) + partial

    def step_sequences(self, step: int, n: int, seed: int | None = None) -> list[tuple[int, np.ndarray]]:
        """``(g, tokens)`` of the ``n`` sequences optimizer step ``step`` reads: global ``step*n ... step*n+n-1``.

        Global (every rank gets the same list and takes its share), so resume at ``step`` is exact."""
        if step < 0 or n < 1:
            raise ConfigError(f"step_sequences(step={step}, n={n}): step must be >= 0 and n >= 1")
        return [(g, self.global_sequence(g, seed)) for g in range(step * n, step * n + n)]

    def step_lengths(self, step: int, n: int, seed: int | None = None) -> np.ndarray:
        """Token counts of :meth:`step_sequences`'s sequences, from the index alone (plan chunks and balance DP
        ranks before reading any token)."""
        if step < 0 or n < 1:
            raise ConfigError(f"step_lengths(step={step}, n={n}): step must be >= 0 and n >= 1")
        return self.lengths[[self.global_index(g, seed) for g in range(step * n, step * n + n)]]


def sequence_splits(
    indexed: IndexedDataset, data_cfg: DataConfig, eod_id: int, max_length: int | None = None, truncate: bool = True
) -> tuple[SequenceDataset, SequenceDataset]:
    """(train, valid) sequence splits of one corpus: the documents packing's splits hold."""
    from megasparse.data.dataset import split_documents

    train_ids, valid_ids = split_documents(len(indexed), data_cfg.valid_fraction, data_cfg.seed)
    kw = dict(max_length=max_length, seed=data_cfg.seed, truncate=truncate)
    train = SequenceDataset(indexed, train_ids, eod_id, shuffle=True, name="train", **kw)
    valid = SequenceDataset(indexed, valid_ids, eod_id, shuffle=False, name="valid", **kw)
    for ds in (train, valid):
        if len(ds) == 0:
            raise DataError(
                f"{indexed.prefix}: the {ds.name} split has no non-empty documents; use more data or another "
                "data.valid_fraction"
            )
    return train, valid


def build_sequence_datasets(
    data_cfg: DataConfig,
    max_length: int | None = None,
    vocab_size: int | None = None,
    rank0_builds: bool = True,
    truncate: bool = True,
) -> tuple[SequenceDataset, SequenceDataset, int]:
    """(train, valid, vocabulary size) of ``data.prefix`` as whole sequences; ``data.blend`` is refused.

    Resolves ``builtin:`` data and the tokenizer as packing does (:func:`~megasparse.data.dataset.resolve_sources`)
    and checks every token id against ``vocab_size`` (the model's, default the tokenizer's)."""
    from megasparse.data.dataset import resolve_sources

    if data_cfg.blend is not None:
        raise ConfigError("data.blend: variable-length sequences read one corpus; set data.prefix instead")
    (prefix,), info = resolve_sources(data_cfg, vocab_size, rank0_builds)
    indexed = IndexedDataset(prefix)
    indexed.check_vocab(vocab_size if vocab_size is not None else info.vocab_size)
    return (*sequence_splits(indexed, data_cfg, info.eod_id, max_length, truncate), info.vocab_size)
