"""GPT training samples: documents packed with EOD between them, split by document, read in a seeded order.

Packing. A split's documents (in file order) form one token stream, each document followed by EOD (the
EOD already written by ``preprocess`` is reused; one is inserted where a foreign dataset lacks it). Sample
``i`` is the window ``stream[i*S : i*S + S + 1]`` for ``S = seq_length``: inputs ``[:-1]``, labels ``[1:]``,
so consecutive samples overlap by one token and every stream token except the first is a label once.

Split. ``valid_fraction`` of the documents, picked by a permutation seeded with ``data.seed``, form the
validation stream; the rest the training stream. Splits never share a document or a window.

Order. The global sample stream is epoch after epoch of a seeded permutation of the training samples
(``seed``, ``epoch``); the validation split is read in order. Global sample ``g`` is fully determined by
``(seed, g)``, which is what makes resuming exact (see :func:`batch_iterator`).

Blends (``data.blend``). Every corpus is split and packed as above, then ``blend.py``'s
:class:`~megasparse.data.blend.BlendedDataset` deals the global samples out to the corpora' train parts by
weight (Megatron's greedy); validation is the same blend over the valid parts. Sample ``g`` still depends only
on ``(seed, g)`` and the blend.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from megasparse.configbase import ConfigError
from megasparse.data.batch import Batch
from megasparse.data.blend import BlendedDataset
from megasparse.data.config import DataConfig
from megasparse.data.indexed import DataError, IndexedDataset
from megasparse.data.tokenizer import BUILTIN_PREFIX, TokenizerInfo, tokenizer_info

if TYPE_CHECKING:
    from megasparse.config import Config

__all__ = [
    "BlendedDataset",
    "PackedDataset",
    "SyntheticData",
    "TokenizerInfo",
    "batch_iterator",
    "build_data",
    "build_datasets",
    "iterate_batches",
    "reference_prefix",
    "resolve_sources",
    "split_documents",
]


def split_documents(num_docs: int, valid_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, valid) document ids, each sorted; at least one document on each side."""
    if num_docs < 2:
        raise DataError(f"the dataset has {num_docs} document(s); a train/validation split needs at least 2")
    n_valid = min(num_docs - 1, max(1, int(round(num_docs * valid_fraction))))
    perm = np.random.default_rng([seed, 0x5B1]).permutation(num_docs)
    return np.sort(perm[n_valid:]), np.sort(perm[:n_valid])


class PackedDataset(torch.utils.data.Dataset):
    """Fixed-length windows over one split's EOD-separated documents (see the module docstring)."""

    def __init__(
        self,
        indexed: IndexedDataset,
        doc_ids: np.ndarray,
        seq_length: int,
        eod_id: int,
        seed: int = 1234,
        shuffle: bool = True,
        name: str = "train",
    ) -> None:
        if seq_length < 1:
            raise ConfigError(f"model.seq_length={seq_length} must be >= 1")
        self.indexed, self.seq_length, self.eod_id = indexed, seq_length, eod_id
        self.seed, self.shuffle, self.name = seed, shuffle, name
        self.doc_ids = np.asarray(doc_ids, dtype=np.int64)
        self._starts = indexed.doc_starts[self.doc_ids]
        self._lens = indexed.doc_lengths[self.doc_ids]
        ends_eod = np.zeros(len(self.doc_ids), dtype=bool)
        nonempty = self._lens > 0
        if indexed.num_tokens:
            ends_eod[nonempty] = indexed.tokens[self._starts[nonempty] + self._lens[nonempty] - 1] == eod_id
        self._add_eod = ~ends_eod
        self._cum = np.zeros(len(self.doc_ids) + 1, dtype=np.int64)
        np.cumsum(self._lens + self._add_eod, out=self._cum[1:])
        self.num_tokens = int(self._cum[-1])
        """Tokens in this split's stream, EODs included."""
        self.num_samples = max(0, (self.num_tokens - 1) // seq_length)
        self._order_cache: tuple[int, int, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.num_samples

    def positions(self, i: int) -> np.ndarray:
        """Positions in the ``.bin`` of sample ``i``'s ``seq_length + 1`` tokens; -1 marks an inserted EOD.

        Gathering any per-token array aligned with the ``.bin`` at these positions (a reference-loss sidecar,
        say) yields values aligned with the sample.
        """
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.name} split of {self.num_samples} samples")
        lo, hi = i * self.seq_length, i * self.seq_length + self.seq_length + 1
        out = np.empty(hi - lo, dtype=np.int64)
        d = int(np.searchsorted(self._cum, lo, side="right")) - 1
        n = 0
        while n < len(out):
            s0, length = int(self._cum[d]), int(self._lens[d])
            a, b = max(lo, s0), min(hi, s0 + length)
            if b > a:  # real tokens of document d inside the window
                base = int(self._starts[d]) - s0
                out[n : n + b - a] = np.arange(a + base, b + base)
                n += b - a
            if self._add_eod[d] and lo <= s0 + length < hi:
                out[n] = -1
                n += 1
            d += 1
        return out

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens_at(self.positions(int(i)))

    def tokens_at(self, pos: np.ndarray) -> torch.Tensor:
        """The tokens at ``.bin`` positions ``pos`` (as from :meth:`positions`; -1 reads as EOD)."""
        real = pos >= 0
        toks = np.full(len(pos), self.eod_id, dtype=np.int64)
        toks[real] = self.indexed.tokens[pos[real]]
        return torch.from_numpy(toks)

    def epoch_order(self, epoch: int, seed: int | None = None) -> np.ndarray:
        """Sample ids in the order epoch ``epoch`` reads them."""
        seed = self.seed if seed is None else seed
        if not self.shuffle:
            return np.arange(self.num_samples)
        if self._order_cache is None or self._order_cache[:2] != (seed, epoch):
            order = np.random.default_rng([seed, epoch, 0x0DE]).permutation(self.num_samples)
            self._order_cache = (seed, epoch, order)
        return self._order_cache[2]

    def global_sample(self, g: int, seed: int | None = None) -> torch.Tensor:
        """The ``g``-th sample of the endless epoch-by-epoch stream."""
        return self[self.global_index(g, seed)]

    def global_index(self, g: int, seed: int | None = None) -> int:
        """Sample id (for :meth:`positions`) of the ``g``-th sample of the endless epoch-by-epoch stream."""
        if self.num_samples == 0:
            raise DataError(
                f"{self.name} split has {self.num_tokens} tokens, fewer than seq_length+1={self.seq_length + 1}; "
                "use more data, a shorter model.seq_length or another data.valid_fraction"
            )
        epoch, k = divmod(g, self.num_samples)
        return int(self.epoch_order(epoch, seed)[k])

    def global_positions(self, g: int, seed: int | None = None) -> np.ndarray:
        """``.bin`` positions (:meth:`positions`) of the ``g``-th sample of the endless stream."""
        return self.positions(self.global_index(g, seed))


class SyntheticData:
    """Seeded random tokens (``data.prefix: synthetic``) for tests and benchmarks that need no corpus."""

    def __init__(self, vocab: int, seq: int, seed: int, n: int = 4096):
        self.vocab, self.seq, self.seed, self.n = vocab, seq, seed, n

    def __len__(self) -> int:
        return self.n

    def global_sample(self, g: int, seed: int | None = None) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + g)
        return torch.randint(0, self.vocab, (self.seq + 1,), generator=gen)


AnyDataset = PackedDataset | BlendedDataset | SyntheticData
"""What the trainer reads: one packed split, a blend of several, or synthetic tokens."""


def batch_iterator(ds: AnyDataset, micro_batch_size: int, *args, **kwargs) -> Iterator[torch.Tensor]:
    """Endless micro-batches ``[micro_batch_size, seq_length + 1]`` (int64) for one data-parallel rank: the
    tokens of :func:`iterate_batches` (same arguments, scheme and resume rule)."""
    return (b.tokens for b in iterate_batches(ds, micro_batch_size, *args, **kwargs))


def iterate_batches(
    ds: AnyDataset,
    micro_batch_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    start_sample: int = 0,
    seed: int | None = None,
) -> Iterator[Batch]:
    """Endless :class:`Batch` micro-batches for one data-parallel rank: tokens, sample ids, ``.bin`` offsets.

    Scheme: global samples are consumed in rounds of ``micro_batch_size * dp_size``; in round ``k`` rank
    ``r`` gets global samples ``start + (k*dp_size + r)*micro`` ... ``+ micro - 1``. Equivalently global
    micro-batch ``m`` (``micro`` consecutive samples) goes to rank ``m % dp_size``. So a global batch of
    ``G`` samples starting at ``consumed_samples`` is the same ``G`` samples — split into the same
    micro-batches — for every DP size; DP=2 just deals them out alternately.

    Resuming: pass the checkpoint's ``consumed_samples`` (global, over all ranks) as ``start_sample``; it
    must be a multiple of ``micro_batch_size * dp_size`` (true after whole global batches). The samples
    yielded are exactly those the uninterrupted run would have read next.
    """
    if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ConfigError(f"batch_iterator: bad micro_batch_size={micro_batch_size} / dp_rank={dp_rank}/{dp_size}")
    per_round = micro_batch_size * dp_size
    if start_sample < 0 or start_sample % per_round:
        raise ConfigError(
            f"resume offset consumed_samples={start_sample} is not a multiple of micro_batch_size x dp = "
            f"{per_round}; resume at a global-batch boundary"
        )
    g = start_sample + dp_rank * micro_batch_size
    packed = isinstance(ds, (PackedDataset, BlendedDataset))
    while True:
        gs = range(g, g + micro_batch_size)
        samples = torch.tensor(list(gs), dtype=torch.int64)
        if packed:  # the offsets come with the tokens: one positions() walk per sample
            pos = np.stack([ds.global_positions(i, seed) for i in gs])
            yield Batch(torch.stack([ds.tokens_at(p) for p in pos]), samples, torch.from_numpy(pos))
        else:
            yield Batch(torch.stack([ds.global_sample(i, seed) for i in gs]), samples)
        g += per_round


MILTON = "builtin:milton"
"""The bundled reference corpus (Milton), tokenized with builtin:shakespeare's tokenizer: a reference model's data."""


def _is_builtin(spec: str | None) -> bool:
    return bool(spec) and spec.startswith(BUILTIN_PREFIX)


def _builtin(data_cfg: DataConfig, rank0_builds: bool):
    from megasparse.data.builtin import ensure_builtin

    name = data_cfg.prefix if _is_builtin(data_cfg.prefix) else data_cfg.tokenizer
    return ensure_builtin(
        "builtin:shakespeare" if name == MILTON else name,  # the reference corpus is built with shakespeare's
        cache_dir=data_cfg.cache_dir,
        vocab_size=data_cfg.tokenizer_vocab,
        builder=None if rank0_builds else True,
    )


def _sources(data_cfg: DataConfig) -> list[str]:
    """The dataset specs a run reads: ``data.prefix``, or every ``data.blend`` entry's prefix."""
    return [p for _, p in data_cfg.blend_entries()] if data_cfg.blend is not None else [data_cfg.prefix]


def _split(indexed: IndexedDataset, data_cfg: DataConfig, seq_length: int, eod_id: int):
    """(train, valid) packed splits of one corpus; both must hold at least one sample."""
    train_ids, valid_ids = split_documents(len(indexed), data_cfg.valid_fraction, data_cfg.seed)
    train = PackedDataset(indexed, train_ids, seq_length, eod_id, data_cfg.seed, shuffle=True, name="train")
    valid = PackedDataset(indexed, valid_ids, seq_length, eod_id, data_cfg.seed, shuffle=False, name="valid")
    for ds in (train, valid):
        if len(ds) == 0:
            raise DataError(
                f"{indexed.prefix}: the {ds.name} split has {ds.num_tokens} tokens, fewer than seq_length+1="
                f"{seq_length + 1}; use more data, a shorter model.seq_length or another data.valid_fraction"
            )
    return train, valid


def resolve_sources(
    data_cfg: DataConfig, vocab_size: int | None = None, rank0_builds: bool = True
) -> tuple[list[str], TokenizerInfo]:
    """(indexed-dataset prefixes of ``data.prefix`` or every ``data.blend`` entry, tokenizer info): ``builtin:``
    specs built on first use and replaced by their paths; ``vocab_size`` (the model's) checked against the
    tokenizer's."""
    specs, tok_spec = _sources(data_cfg), data_cfg.tokenizer
    prefixes = list(specs)
    if any(map(_is_builtin, specs)) or _is_builtin(tok_spec):
        paths = _builtin(data_cfg, rank0_builds)
        for i, spec in enumerate(specs):
            if not _is_builtin(spec):
                continue
            if not _is_builtin(tok_spec):
                key = "data.prefix" if data_cfg.blend is None else "data.blend entry"
                raise ConfigError(
                    f"{key} {spec} is tokenized with the built-in tokenizer; set data.tokenizer=builtin:shakespeare"
                )
            prefixes[i] = paths.reference_prefix if spec == MILTON else paths.prefix
        if _is_builtin(tok_spec):
            tok_spec = str(paths.tokenizer)
    info = tokenizer_info(tok_spec)
    if vocab_size is not None and vocab_size < info.vocab_size:
        raise ConfigError(
            f"model.vocab_size={vocab_size} is smaller than the tokenizer's {info.vocab_size} ({info.path}); "
            "leave it null to use the tokenizer's"
        )
    return prefixes, info


def build_datasets(
    data_cfg: DataConfig,
    seq_length: int,
    vocab_size: int | None = None,
    rank0_builds: bool = True,
) -> tuple[PackedDataset | BlendedDataset, PackedDataset | BlendedDataset, TokenizerInfo]:
    """(train, valid, tokenizer info) for a run; builds ``builtin:`` data on first use.

    With ``data.blend`` every corpus is split and packed alone and the splits are blended by weight: train
    over the train parts, valid over the valid parts. ``vocab_size`` is the model's (padded) vocabulary:
    every token id of every dataset must be below it (checked with one pass over each mmap).
    ``rank0_builds``: only local rank 0 builds built-in data while the node's other ranks wait (False: each
    process builds under the cache lock, first one wins).
    """
    prefixes, info = resolve_sources(data_cfg, vocab_size, rank0_builds)
    splits = []
    for prefix in prefixes:
        indexed = IndexedDataset(prefix)
        indexed.check_vocab(vocab_size if vocab_size is not None else info.vocab_size)
        splits.append(_split(indexed, data_cfg, seq_length, info.eod_id))
    if data_cfg.blend is None:
        return (*splits[0], info)
    weights = [w for w, _ in data_cfg.blend_entries()]
    train = BlendedDataset([t for t, _ in splits], weights, name="train")
    valid = BlendedDataset([v for _, v in splits], weights, name="valid", index=train.index)
    return train, valid, info


def build_data(cfg: Config) -> tuple[AnyDataset, AnyDataset, int]:
    """(train, valid, vocab_size) of a run — vocab from the tokenizer unless model.vocab_size is set."""
    if cfg.data.prefix == "synthetic" and cfg.data.blend is None:
        if cfg.model.vocab_size is None:
            raise ConfigError("data.prefix=synthetic needs model.vocab_size")
        v = cfg.model.vocab_size
        return (
            SyntheticData(v, cfg.model.seq_length, cfg.data.seed),
            SyntheticData(v, cfg.model.seq_length, cfg.data.seed + 1, n=256),
            v,
        )
    train, valid, info = build_datasets(cfg.data, cfg.model.seq_length, cfg.model.vocab_size)
    return train, valid, cfg.model.vocab_size or info.vocab_size


def reference_prefix(data_cfg: DataConfig, rank0_builds: bool = True) -> str | None:
    """Indexed dataset of the reference (high-quality) corpus for token filtering, or None if there is none.

    ``data.reference_prefix`` if set; otherwise the bundled Milton corpus when the data (any blend entry) is
    built-in.
    """
    if data_cfg.reference_prefix:
        IndexedDataset(data_cfg.reference_prefix)  # fail early with a clear message
        return data_cfg.reference_prefix
    if any(map(_is_builtin, _sources(data_cfg))):
        return _builtin(data_cfg, rank0_builds).reference_prefix
    return None
