"""Interpolated modified Kneser-Ney n-gram LM over token ids: a reference whose cost is negligible (Collider §4.3).

Built with numpy only: every n-gram is packed into one int64 key (base ``vocab_size + 1``, the extra id is the
begin-of-document pad), counted with ``np.unique`` and looked up with ``np.searchsorted``. A 2M-token corpus fits
in a few seconds on one core.

Model (Chen & Goodman's interpolated modified KN, with KenLM's treatment of document starts):

- each document is left-padded with ``order - 1`` BOS ids, so every real token has a full context and the
  first token of a document is predicted from "start of document";
- the highest order uses raw counts; lower orders use continuation counts (distinct left extensions), except
  n-grams starting with BOS, which cannot be extended to the left and keep their raw counts;
- three discounts per order (for adjusted counts 1, 2, 3+) from count-of-counts, clipped to a valid range;
- ``P_n(w|h) = max(a(hw) − D(a(hw)), 0) / A(h) + γ(h) · P_{n−1}(w|h')`` with γ(h) the discounted mass, and
  ``P_{n−1}`` used unchanged for unseen contexts; the unigram interpolates with the uniform ``1 / vocab_size``.

So ``P(·|h)`` sums to one over the vocabulary for every context, seen or not (tests check it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from megasparse.configbase import ConfigError

__all__ = ["NgramLM"]

_FORMAT_VERSION = 1


def _discounts(adjusted: np.ndarray) -> np.ndarray:
    """Modified-KN discounts D1, D2, D3+ from count-of-counts, clipped into (0, k] so probabilities stay valid.

    When a count-of-count n1..n4 is zero (tiny or degenerate data) the estimate is undefined; classic KN's
    single discount 0.75 is used instead.
    """
    nk = [int(np.count_nonzero(adjusted == k)) for k in (1, 2, 3, 4)]
    if min(nk) == 0:
        return np.full(3, 0.75)
    y = nk[0] / (nk[0] + 2 * nk[1])
    d = [k - (k + 1) * y * nk[k] / nk[k - 1] for k in (1, 2, 3)]
    return np.asarray([min(max(dk, 0.05), float(k)) for k, dk in zip((1, 2, 3), d)], dtype=np.float64)


def _context_stats(
    keys: np.ndarray, counts: np.ndarray, base: int, disc: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For sorted n-gram keys: (context keys, γ per context, discounted probability per n-gram)."""
    ctx = keys // base  # sorted, since key = ctx * base + word with word < base
    ctx_keys, start, n_in = np.unique(ctx, return_index=True, return_counts=True)
    total = np.add.reduceat(counts, start).astype(np.float64)
    d_of = disc[np.minimum(counts, 3) - 1]
    mass = np.add.reduceat(d_of, start)  # D1·N1 + D2·N2 + D3·N3+ for each context
    gamma = mass / total
    alpha = np.maximum(counts - d_of, 0.0) / np.repeat(total, n_in)
    return ctx_keys, gamma, alpha


@dataclass
class _Order:
    """Tables of one order n ≥ 2: n-gram keys with their discounted probability, contexts with their γ."""

    keys: np.ndarray
    alpha: np.ndarray
    ctx_keys: np.ndarray
    gamma: np.ndarray


@dataclass
class NgramLM:
    """A fitted KN model. Build with ``NgramLM.fit``; persist with ``save`` / ``NgramLM.load``."""

    order: int
    vocab_size: int
    eod_id: int | None
    unigram_alpha: np.ndarray
    unigram_gamma: float
    orders: list[_Order] = field(default_factory=list)
    """Tables of orders 2..order."""
    discounts: np.ndarray = field(default_factory=lambda: np.zeros((0, 3)))
    """[order, 3]: D1, D2, D3+ per order (row 0 is the unigram)."""

    @property
    def bos(self) -> int:
        return self.vocab_size

    @property
    def base(self) -> int:
        return self.vocab_size + 1

    # ------------------------------------------------------------------ fitting
    @classmethod
    def fit(
        cls,
        tokens: np.ndarray | torch.Tensor,
        vocab_size: int,
        *,
        order: int = 3,
        eod_id: int | None = None,
        doc_starts: np.ndarray | None = None,
    ) -> NgramLM:
        """Fit on a flat token stream. Documents end after each ``eod_id`` and/or start at ``doc_starts``."""
        tokens = _as_int64(tokens)
        _check_shape(order, vocab_size)
        _check_ids(tokens, vocab_size)
        if tokens.size == 0:
            raise ConfigError("cannot fit an n-gram model on an empty token stream; check --data")
        base = vocab_size + 1
        ctx = _contexts(tokens, order, vocab_size, eod_id, doc_starts)
        full = _pack(ctx, tokens, base)

        keys, counts = np.unique(full, return_counts=True)
        discounts = np.zeros((order, 3))
        tables: list[_Order] = []
        for n in range(order, 1, -1):
            disc = _discounts(counts)
            discounts[n - 1] = disc
            ctx_keys, gamma, alpha = _context_stats(keys, counts, base, disc)
            tables.append(_Order(keys=keys, alpha=alpha, ctx_keys=ctx_keys, gamma=gamma))
            keys, counts = _lower_order(keys, counts, n, base, vocab_size)

        # Unigram over real ids: keys are the words themselves.
        discounts[0] = _discounts(counts)
        _, gamma, alpha = _context_stats(keys, counts, base, discounts[0])
        uni = np.zeros(vocab_size, dtype=np.float64)
        uni[keys] = alpha
        gamma0 = float(gamma[0])
        return cls(
            order=order,
            vocab_size=vocab_size,
            eod_id=eod_id,
            unigram_alpha=uni,
            unigram_gamma=gamma0,
            orders=tables[::-1],
            discounts=discounts,
        )

    # ------------------------------------------------------------------ querying
    def prob(self, context: np.ndarray, words: np.ndarray) -> np.ndarray:
        """P(word | context) for rows of ``context`` [m, order-1] (BOS-padded on the left) and ``words`` [m]."""
        words = np.asarray(words, dtype=np.int64).reshape(-1)
        context = np.asarray(context, dtype=np.int64).reshape(len(words), self.order - 1)
        p = self.unigram_alpha[words] + self.unigram_gamma / self.vocab_size
        h = np.zeros(len(words), dtype=np.int64)
        for n, tab in enumerate(self.orders, start=2):
            h = _ctx_key_extend(h, context[:, self.order - n], n - 1, self.base)
            ci = np.minimum(np.searchsorted(tab.ctx_keys, h), len(tab.ctx_keys) - 1)
            g = h * self.base + words
            gi = np.minimum(np.searchsorted(tab.keys, g), len(tab.keys) - 1)
            alpha = np.where(tab.keys[gi] == g, tab.alpha[gi], 0.0)
            p = np.where(tab.ctx_keys[ci] == h, alpha + tab.gamma[ci] * p, p)
        return p

    def distribution(self, context: list[int] | np.ndarray) -> np.ndarray:
        """P(· | context) over the whole vocabulary, float64 [vocab_size]; context shorter than order-1 is
        treated as the start of a document."""
        c = list(np.asarray(context, dtype=np.int64).reshape(-1))[-(self.order - 1) :] if self.order > 1 else []
        c = [self.bos] * (self.order - 1 - len(c)) + c
        words = np.arange(self.vocab_size, dtype=np.int64)
        return self.prob(np.tile(np.asarray(c, np.int64), (self.vocab_size, 1)), words)

    def stream_losses(self, tokens: np.ndarray, *, doc_starts: np.ndarray | None = None) -> np.ndarray:
        """NLL (nats, float64) of each token of a flat stream given its prefix within its document."""
        tokens = _as_int64(tokens)
        _check_ids(tokens, self.vocab_size)
        ctx = _contexts(tokens, self.order, self.vocab_size, self.eod_id, doc_starts)
        return -np.log(self.prob(ctx, tokens))

    def token_losses(self, tokens: torch.Tensor) -> torch.Tensor:
        """Per-token NLL in nats, float32, same shape as ``tokens`` ([s, b] or [n]).

        ``out[t]`` is the loss of ``tokens[t]`` given the previous ``order − 1`` tokens of its document. Each
        column starts a document at row 0 (its true prefix is unknown), and a document ends after ``eod_id``.
        To align with LM labels (``labels[t] = tokens[t + 1]``) use ``label_losses``.
        """
        t2 = tokens.unsqueeze(1) if tokens.dim() == 1 else tokens
        cols = t2.detach().cpu().numpy().astype(np.int64).T  # [b, s]
        s = cols.shape[1]
        starts = np.arange(cols.shape[0], dtype=np.int64) * s
        out = self.stream_losses(cols.reshape(-1), doc_starts=starts).reshape(cols.shape).T
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(tokens.shape).to(tokens.device)

    def label_losses(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Reference losses aligned with LM labels: ``out[t]`` = NLL of ``labels[t]`` given ``tokens[..t]``."""
        full = torch.cat([tokens[:1], labels], dim=0)
        return self.token_losses(full)[1:]

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | os.PathLike) -> None:
        """Write an uncompressed .npz (loads by mmap-free np.load in well under a second)."""
        arrays = {
            "meta": np.asarray(
                [_FORMAT_VERSION, self.order, self.vocab_size, -1 if self.eod_id is None else self.eod_id]
            ),
            "unigram_alpha": self.unigram_alpha,
            "unigram_gamma": np.asarray([self.unigram_gamma]),
            "discounts": self.discounts,
        }
        for n, tab in enumerate(self.orders, start=2):
            arrays.update(
                {f"keys{n}": tab.keys, f"alpha{n}": tab.alpha, f"ctx{n}": tab.ctx_keys, f"gamma{n}": tab.gamma}
            )
        tmp = f"{os.fspath(path)}.tmp{os.getpid()}.npz"
        np.savez(tmp, **arrays)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> NgramLM:
        try:
            z = np.load(path)
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"filter.ngram_path={os.fspath(path)!r} cannot be read ({e}); run `megasparse ref ngram`"
            ) from e
        with z:
            version, order, vocab, eod = (int(v) for v in z["meta"])
            if version != _FORMAT_VERSION:
                raise ConfigError(
                    f"{os.fspath(path)}: n-gram format version {version}, expected {_FORMAT_VERSION}; re-run "
                    "`megasparse ref ngram`"
                )
            tables = [
                _Order(keys=z[f"keys{n}"], alpha=z[f"alpha{n}"], ctx_keys=z[f"ctx{n}"], gamma=z[f"gamma{n}"])
                for n in range(2, order + 1)
            ]
            return cls(
                order=order,
                vocab_size=vocab,
                eod_id=None if eod < 0 else eod,
                unigram_alpha=z["unigram_alpha"],
                unigram_gamma=float(z["unigram_gamma"][0]),
                orders=tables,
                discounts=z["discounts"],
            )


# ---------------------------------------------------------------------- helpers
def _as_int64(tokens: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    return np.asarray(tokens).astype(np.int64, copy=False).reshape(-1)


def _check_shape(order: int, vocab_size: int) -> None:
    if order < 1:
        raise ConfigError(f"n-gram order {order} must be >= 1")
    if vocab_size < 1:
        raise ConfigError(f"vocab_size {vocab_size} must be >= 1")
    if (vocab_size + 1) ** order >= 2**63:
        raise ConfigError(
            f"n-gram order {order} with vocab_size {vocab_size} does not pack into int64 keys; use a lower --order"
        )


def _check_ids(tokens: np.ndarray, vocab_size: int) -> None:
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ConfigError(
            f"token ids [{tokens.min()}, {tokens.max()}] fall outside vocab_size {vocab_size}; pass the tokenizer "
            "the data was built with"
        )


def _contexts(
    tokens: np.ndarray, order: int, vocab_size: int, eod_id: int | None, doc_starts: np.ndarray | None
) -> np.ndarray:
    """[n, order-1] contexts (oldest first), BOS where the context would cross a document start."""
    n = tokens.size
    new_doc = np.zeros(n, dtype=bool)
    if n:
        new_doc[0] = True
    if eod_id is not None and n > 1:
        new_doc[1:] |= tokens[:-1] == eod_id
    if doc_starts is not None:
        ds = np.asarray(doc_starts, dtype=np.int64)
        new_doc[ds[(ds >= 0) & (ds < n)]] = True
    start_of = np.maximum.accumulate(np.where(new_doc, np.arange(n), 0))
    pos = np.arange(n) - start_of
    ctx = np.full((n, max(order - 1, 0)), vocab_size, dtype=np.int64)
    for j in range(1, order):  # column order-1-j holds the token j steps back
        ok = pos >= j
        ctx[ok, order - 1 - j] = tokens[np.nonzero(ok)[0] - j]
    return ctx


def _pack(ctx: np.ndarray, words: np.ndarray, base: int) -> np.ndarray:
    key = np.zeros(words.size, dtype=np.int64)
    for j in range(ctx.shape[1]):
        key = key * base + ctx[:, j]
    return key * base + words


def _ctx_key_extend(h: np.ndarray, older: np.ndarray, length: int, base: int) -> np.ndarray:
    """Context key of length ``length`` from the key of its last ``length − 1`` tokens and one older token."""
    return older * base ** (length - 1) + h


def _lower_order(keys: np.ndarray, counts: np.ndarray, n: int, base: int, bos: int) -> tuple[np.ndarray, np.ndarray]:
    """Adjusted counts of order n−1 from the n-gram types: distinct left extensions, raw counts after BOS."""
    low = base ** (n - 1)
    suffix = keys % low
    order_idx = np.argsort(suffix, kind="stable")
    suffix_sorted = suffix[order_idx]
    low_keys, start, continuation = np.unique(suffix_sorted, return_index=True, return_counts=True)
    raw = np.add.reduceat(counts[order_idx], start)
    starts_with_bos = (low_keys // base ** (n - 2)) == bos
    adjusted = np.where(starts_with_bos, raw, continuation)
    return low_keys, adjusted.astype(np.int64)
