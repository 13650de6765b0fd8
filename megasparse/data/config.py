"""Data config: indexed datasets, tokenizer, packing and the validation split."""

from __future__ import annotations

from dataclasses import dataclass

from megasparse.configbase import ConfigError


@dataclass
class DataConfig:
    """Where tokens come from. ``prefix`` names a Megatron indexed dataset (prefix.bin / prefix.idx)."""

    prefix: str = "builtin:shakespeare"
    """Indexed-dataset prefix, or ``builtin:shakespeare`` to build the bundled corpus on first use."""
    tokenizer: str = "builtin:shakespeare"
    """Path to a tokenizers JSON file, or ``builtin:shakespeare`` (a BPE trained offline on the corpus)."""
    tokenizer_vocab: int = 8192
    """Vocabulary size of the built-in BPE (only used for ``builtin:`` tokenizers)."""
    cache_dir: str = "~/.cache/megasparse"
    """Where the built-in corpus, tokenizer and indexed dataset are built once (``$MEGASPARSE_CACHE``
    replaces this default)."""
    valid_fraction: float = 0.02
    """Fraction of documents held out for validation (chosen by a seeded shuffle of documents)."""
    seed: int = 1234
    """Seed of the document split and the sample order."""
    reference_prefix: str | None = None
    """Indexed dataset of high-quality reference text (token filtering's reference model / n-gram); with
    ``prefix = builtin:shakespeare`` it defaults to the bundled Milton corpus."""
    ref_losses: str | None = None
    """Optional sidecar of per-token reference losses aligned with ``prefix`` (token filtering)."""

    def validate(self) -> None:
        if not 0.0 < self.valid_fraction < 0.5:
            raise ConfigError(f"data.valid_fraction={self.valid_fraction} must be in (0, 0.5)")
        if self.tokenizer_vocab <= 257:
            raise ConfigError(f"data.tokenizer_vocab={self.tokenizer_vocab} must exceed 257 (bytes + EOD)")
