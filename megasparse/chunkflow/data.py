"""Where ChunkFlow's whole sequences come from: ``data/sequences.py``'s ``SequenceDataset`` (the corpus's
documents whole), or for ``data.prefix=synthetic`` a stand-in stream of random long-tail sequences."""

from __future__ import annotations

import numpy as np

from megasparse.chunkflow.config import known_longest, sequence_limit

__all__ = ["LongTailSequences", "longest_sequence", "sequence_source"]


class LongTailSequences:
    """Deterministic random sequences (token 0 is the end of document) with a long tail of lengths: most about
    ``max_length / 40`` tokens, one in twenty drawn log-uniformly from ``max_length / 8`` to ``max_length``.
    Sequence ``g`` depends only on (seed, g), so a step reads the same on every rank and after a resume."""

    eod_id = 0

    def __init__(self, vocab: int, max_length: int, seed: int = 1234, min_length: int = 2):
        self.vocab, self.max_length, self.seed, self.min_length = vocab, max_length, seed, min_length

    def length(self, g: int) -> int:
        rng = np.random.default_rng([self.seed, g, 0])
        hi = self.max_length
        if rng.random() < 0.05:
            n = np.exp(rng.uniform(np.log(max(hi / 8, 1)), np.log(hi)))
        else:
            n = rng.lognormal(np.log(max(hi / 40, 1)), 0.9)
        return int(np.clip(np.rint(n), self.min_length, hi))

    def sequence(self, g: int) -> np.ndarray:
        n = self.length(g)
        rng = np.random.default_rng([self.seed, g, 1])
        tokens = rng.integers(1, self.vocab, n, dtype=np.int64)
        tokens[-1] = 0
        return tokens

    def predictions_before(self, g: int) -> int:
        """Next-token predictions of sequences ``0 ... g - 1`` (the tokens trained before a resume at ``g``)."""
        return sum(self.length(i) - 1 for i in range(g))

    def step_sequences(self, step: int, n: int) -> list[tuple[int, np.ndarray]]:
        """``(g, tokens)`` of optimizer step ``step``'s ``n`` sequences (global ``step·n … step·n + n − 1``)."""
        return [(g, self.sequence(g)) for g in range(step * n, step * n + n)]


def sequence_source(cfg, vocab: int):
    """The training sequences: the stand-in for synthetic data, else the corpus's documents whole (truncated to
    ``chunkflow.max_sequence_length``, as ``data/sequences.py`` counts and reports)."""
    limit = sequence_limit(cfg)
    if cfg.data.prefix == "synthetic":
        return LongTailSequences(vocab, known_longest(cfg), cfg.data.seed)
    from megasparse.data.sequences import build_sequence_datasets

    train, _, _ = build_sequence_datasets(cfg.data, max_length=limit, vocab_size=vocab)
    return train


def longest_sequence(source, max_length: int | None) -> int | None:
    """The longest sequence a run can meet (tokens): the source's lengths (a corpus's, truncated) where it has them,
    else ``max_length`` or the stand-in's bound; None: unknown. The planner sizes ChunkFlow's K/V store by it."""
    longest = max_length or getattr(source, "max_length", None)
    lengths = getattr(source, "lengths", None)
    if lengths is not None and len(lengths):
        longest = min(longest or 1 << 62, int(np.max(lengths)))
    return longest
