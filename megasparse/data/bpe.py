"""Byte-level BPE: training, the end-of-document id, encoding documents into an indexed dataset.

The tokenizer-level pieces that both the built-in corpus build (``builtin.py``) and the user-facing loaders
(``tokenizer.py``, ``preprocess.py``) need; it imports neither, so the data package has no import cycle.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from megasparse.data.indexed import DataError, IndexedWriter

EOD_TOKEN = "<|endoftext|>"
_EOD_CANDIDATES = (EOD_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


def train_bpe(texts: Iterable[str], vocab_size: int, path: str | os.PathLike, show_progress: bool = False) -> Path:
    """Train a GPT-2 style byte-level BPE with ``<|endoftext|>`` as id 0 and save it as JSON.

    Byte-level means every string encodes (no unknown token), so datasets of any text fit the vocabulary.
    """
    if vocab_size <= 257:
        raise DataError(f"tokenizer vocab_size={vocab_size} must exceed 257 (256 bytes + <|endoftext|>)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def eod_id(tok: Tokenizer, where: str = "tokenizer") -> int:
    for name in _EOD_CANDIDATES:
        i = tok.token_to_id(name)
        if i is not None:
            return int(i)
    raise DataError(f"{where} has no end-of-document token (looked for {', '.join(_EOD_CANDIDATES)}); add one")


def tokenize_into(
    writer: IndexedWriter,
    tok: Tokenizer,
    docs: Iterable[str],
    eod: int,
    batch: int = 256,
    desc: str = "tokenizing",
    total: int | None = None,
) -> int:
    """Encode ``docs`` in batches (tokenizers' Rust threads) and append each with a trailing EOD."""
    n_docs = 0
    buf: list[str] = []
    with tqdm(total=total, desc=desc, unit="doc", file=sys.stderr, mininterval=0.5) as bar:

        def flush() -> None:
            for enc in tok.encode_batch(buf, add_special_tokens=False):
                writer.add_document(np.asarray(enc.ids + [eod], dtype=np.int64))
            bar.update(len(buf))
            buf.clear()

        for doc in docs:
            buf.append(doc)
            n_docs += 1
            if len(buf) == batch:
                flush()
        if buf:
            flush()
    return n_docs
