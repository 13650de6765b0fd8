"""Tokenizer specs: a ``tokenizers`` JSON file or ``builtin:shakespeare`` (built on first use); BPE is in bpe.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from megasparse.data.bpe import eod_id
from megasparse.data.builtin import ensure_builtin
from megasparse.data.indexed import DataError

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


def resolve_tokenizer_path(spec: str, cache_dir: str | None = None, vocab_size: int = 8192) -> Path:
    """JSON path of a tokenizer spec; ``builtin:shakespeare`` builds the bundled corpus first if needed."""
    if spec.startswith(BUILTIN_PREFIX):
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


def tokenizer_info(spec: str, cache_dir: str | None = None, vocab_size: int = 8192) -> TokenizerInfo:
    path = resolve_tokenizer_path(spec, cache_dir, vocab_size)
    tok = load_tokenizer(str(path))
    return TokenizerInfo(vocab_size=tok.get_vocab_size(), eod_id=eod_id(tok, str(path)), path=str(path))
