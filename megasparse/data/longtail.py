"""A synthetic indexed dataset of documents with a long-tail length distribution (tests, ChunkFlow's benchmark).

    megasparse data longtail --output-prefix P [--docs 10000] [--vocab 32000] [--max-length 32768] [--seed 0]
        [--median M] [--sigma 0.95] [--tail-share 0.05] [--min-length 16] [--tokens zipf|uniform]

Lengths (tokens per document, EOD included), drawn per document with ``numpy.random.default_rng(seed)``:

* body, share ``1 - tail_share``: log-normal with median ``median`` (default ``max_length / 40``) and log-sd
  ``sigma``;
* tail, share ``tail_share``: log-uniform between ``max_length / 8`` and ``max_length``;
* everything clipped to ``[min_length, max_length]``.

With the defaults and ``max_length = 32768`` that is about 90% of the documents at or below 4K tokens, a median
near 800, a mean near 1.9K and a tail to 32K whose 5% of the documents hold about a third of the tokens (the
shape of fine-tuning and long-context mixes ChunkFlow targets; ``megasparse data lengths P`` prints the measured
numbers, decision 1211). Token ids are random, Zipf-like over ``[1, vocab)`` by default (rank r drawn ∝
1/(r + 10)) or uniform; id 0 is the EOD that ends every document. The content is meaningless: the set exists
to measure speed and memory under a realistic length mix.

Writes ``P.bin``/``P.idx`` (Megatron's format, uint16 ids below 65500 else int32), ``P.tokenizer.json`` (a
word-level tokenizer of ``vocab`` entries with ``<|endoftext|>`` = 0, so ``data.tokenizer`` can point at it)
and ``P.longtail.json`` (the parameters and :func:`~megasparse.data.lengths.length_report`). Small sets take
milliseconds.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from megasparse.data.bpe import EOD_TOKEN
from megasparse.data.indexed import DataError, IndexedWriter, optimal_dtype

__all__ = ["LongTailSpec", "longtail_lengths", "write_longtail"]

EOD_ID = 0


@dataclass(frozen=True)
class LongTailSpec:
    """The generator's parameters (see the module docstring); ``median=None`` means ``max_length / 40``."""

    docs: int = 10000
    vocab: int = 32000
    max_length: int = 32768
    seed: int = 0
    median: float | None = None
    sigma: float = 0.95
    tail_share: float = 0.05
    min_length: int = 16
    tokens: str = "zipf"

    def check(self) -> None:
        """One-line ``DataError`` for a value the generator cannot use."""
        bad = [
            ("docs", self.docs >= 1, "at least 1"),
            ("vocab", self.vocab >= 2, "at least 2 (EOD + one token)"),
            ("max-length", self.max_length >= 2, "at least 2"),
            ("min-length", 2 <= self.min_length <= self.max_length, "in [2, max-length]"),
            ("sigma", self.sigma >= 0, ">= 0"),
            ("tail-share", 0 <= self.tail_share <= 1, "in [0, 1]"),
            ("median", self.median is None or self.median > 0, "> 0"),
            ("tokens", self.tokens in ("zipf", "uniform"), "zipf or uniform"),
        ]
        for name, ok, want in bad:
            if not ok:
                raise DataError(f"--{name}={getattr(self, name.replace('-', '_'))}: give {want}")


def longtail_lengths(spec: LongTailSpec, rng: np.random.Generator | None = None) -> np.ndarray:
    """Document lengths (int64, EOD included) of the spec's distribution."""
    spec.check()
    rng = rng if rng is not None else np.random.default_rng([spec.seed, 0x1E2])
    median = spec.median if spec.median is not None else spec.max_length / 40
    body = rng.lognormal(np.log(median), spec.sigma, spec.docs)
    lo, hi = np.log(spec.max_length / 8), np.log(spec.max_length)
    tail = np.exp(rng.uniform(lo, hi, spec.docs))
    lengths = np.where(rng.random(spec.docs) < spec.tail_share, tail, body)
    return np.clip(np.rint(lengths), spec.min_length, spec.max_length).astype(np.int64)


def _token_ids(spec: LongTailSpec, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` ids in ``[1, vocab)``: Zipf-like (∝ 1 / (rank + 10)) or uniform."""
    if spec.tokens == "uniform" or spec.vocab == 2:
        return rng.integers(1, spec.vocab, n, dtype=np.int64)
    cdf = np.cumsum(1.0 / (np.arange(1, spec.vocab, dtype=np.float64) + 10))
    cdf /= cdf[-1]
    return np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), spec.vocab - 2).astype(np.int64) + 1


def write_tokenizer(path: str | Path, vocab: int) -> Path:
    """A word-level tokenizer JSON with ``vocab`` entries (``<|endoftext|>`` = 0, ``t1`` ... ``t{vocab-1}``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {EOD_TOKEN: EOD_ID, **{f"t{i}": i for i in range(1, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token=EOD_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return Path(path)


def write_longtail(prefix: str | Path, spec: LongTailSpec) -> dict:
    """Write the dataset, its tokenizer and its manifest (module docstring); returns the manifest."""
    from megasparse.data.lengths import length_report

    spec.check()
    rng = np.random.default_rng([spec.seed, 0x1E2])
    lengths = longtail_lengths(spec, rng)
    ids = _token_ids(spec, int(lengths.sum()), rng)
    ends = np.cumsum(lengths)
    ids[ends - 1] = EOD_ID  # every document ends with EOD
    with IndexedWriter(prefix, optimal_dtype(spec.vocab)) as w:
        for e, n in zip(ends.tolist(), lengths.tolist()):
            w.add_document(ids[e - n : e])
    base = str(w.bin_path)[: -len(".bin")]
    tok = write_tokenizer(base + ".tokenizer.json", spec.vocab)
    manifest = {
        "generator": "megasparse data longtail",
        "spec": asdict(spec),
        "tokenizer": str(tok),
        "eod_id": EOD_ID,
        "report": length_report(lengths),
    }
    manifest["report"]["prefix"] = base
    Path(base + ".longtail.json").write_text(json.dumps(manifest, indent=1))
    return manifest
