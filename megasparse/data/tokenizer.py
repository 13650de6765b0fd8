"""Tokenizers: a byte-level BPE trained offline with HF ``tokenizers``, loaded from JSON or ``builtin:``."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from megasparse.data.indexed import DataError

EOD_TOKEN = "<|endoftext|>"
_EOD_CANDIDATES = (EOD_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
BUILTIN_PREFIX = "builtin:"


@dataclass(frozen=True)
class TokenizerInfo:
    """What the model and the loss need from a tokenizer."""

    vocab_size: int
    """Ids are in [0, vocab_size); the model may pad its embedding beyond it."""
    eod_id: int
    """End-of-document id put between packed documents."""
    path: str
    """The tokenizer JSON file."""


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


def resolve_tokenizer_path(spec: str, cache_dir: str | None = None, vocab_size: int = 8192) -> Path:
    """JSON path of a tokenizer spec; ``builtin:shakespeare`` builds the bundled corpus first if needed."""
    if spec.startswith(BUILTIN_PREFIX):
        from megasparse.data.builtin import ensure_builtin

        return ensure_builtin(spec, cache_dir=cache_dir, vocab_size=vocab_size).tokenizer
    path = Path(spec).expanduser()
    if not path.is_file():
        raise DataError(f"data.tokenizer={spec!r}: no such file; give a tokenizers JSON file or builtin:shakespeare")
    return path


def load_tokenizer(spec: str, cache_dir: str | None = None, vocab_size: int = 8192) -> Tokenizer:
    """Load a tokenizer from a ``tokenizers`` JSON file or ``builtin:shakespeare``."""
    path = resolve_tokenizer_path(spec, cache_dir, vocab_size)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception subclasses with multi-line text
        raise DataError(f"{path} is not a tokenizers JSON file: {str(e).splitlines()[0]}") from e


def eod_id(tok: Tokenizer, where: str = "tokenizer") -> int:
    for name in _EOD_CANDIDATES:
        i = tok.token_to_id(name)
        if i is not None:
            return int(i)
    raise DataError(f"{where} has no end-of-document token (looked for {', '.join(_EOD_CANDIDATES)}); add one")


def tokenizer_info(spec: str, cache_dir: str | None = None, vocab_size: int = 8192) -> TokenizerInfo:
    path = resolve_tokenizer_path(spec, cache_dir, vocab_size)
    tok = load_tokenizer(str(path))
    return TokenizerInfo(vocab_size=tok.get_vocab_size(), eod_id=eod_id(tok, str(path)), path=str(path))
