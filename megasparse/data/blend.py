"""Blended datasets: several corpora mixed by weight, sample by sample, as megatron-core's ``BlendedDataset`` does.

The blend index. Global sample ``n`` of a blend comes from dataset ``argmax_k (w_k * max(n, 1) - c_k(n))``, where
``c_k(n)`` counts the samples dataset ``k`` gave before ``n`` (ties to the lower index): each sample goes to the
dataset whose achieved share lags its weight the most. This is megatron-core's ``build_blending_indices``
(``helpers.cpp``), reproduced bit for bit (same float64 products and subtractions, same tie rule;
tests/test_blend.py compares them). The sample taken from dataset ``k`` is its ``c_k(n)``-th, which the dataset
maps to a sample of its own seeded, epoch-by-epoch order.

Two builders, same output. ``blend_kernel.py``: the loop in C, compiled once per machine on first use (the
default: as fast as megatron's). Without a C compiler, the numpy build below: the greedy is sequential, but two
runs of it started from different counts at the same ``n`` coalesce within a few samples (the lagging dataset is
picked first either way). So the samples are cut into ``B`` chunks that all run at once, vectorised over chunks,
each starting from a guess of its counts (the largest-remainder rounding of ``w * n``); chunk 0 starts from the
true counts, and a chunk whose guess differs from where its predecessor ended is re-run from that end (all such
chunks at once) until the run meets its old trajectory. When every chunk starts where its predecessor ended, the
result is the sequential greedy's. It is close to the C loop with a few corpora and slower with many or with
tiny weights (decision 0103 has the timings).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from megasparse.data import blend_kernel
from megasparse.data.indexed import DataError

__all__ = ["BlendIndex", "BlendedDataset", "blend_indices", "normalize_weights"]

_MAX_CHUNKS = 8192  # chunks run side by side: enough to amortise numpy's per-call cost
_MIN_CHUNK = 256


def normalize_weights(weights) -> np.ndarray:
    """float64 weights divided by their sum, as megatron-core's ``normalize`` does before building the index."""
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if len(w) == 0 or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise DataError(f"blend weights {w.tolist()} must be positive and finite")
    if len(w) >= 32767:
        raise DataError(f"a blend of {len(w)} datasets does not fit megatron's int16 dataset index (< 32767)")
    return w / w.sum()


def _guess_counts(w: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """[K, B] float64: ``floor(w * n)`` plus the leftover samples to the largest remainders (a start guess)."""
    x = w[:, None] * starts[None, :].astype(np.float64)
    c = np.floor(x)
    left = starts - c.sum(0).astype(np.int64)
    rank = np.argsort(np.argsort(c - x, axis=0, kind="stable"), axis=0, kind="stable")
    return c + (rank < left[None, :])


def _run(w: np.ndarray, starts: np.ndarray, c: np.ndarray, di: np.ndarray, dsi: np.ndarray, old=None) -> bool:
    """The greedy on every chunk at once: chunk ``b`` runs samples ``starts[b] + t`` for ``t < len(di)``.

    ``c`` [K, B] float64 holds the counts at the chunk starts and ends as the counts after the chunk. ``di`` /
    ``dsi`` [L, B] receive the dataset and the within-dataset sample index. ``old`` [K, B]: counts at the starts
    of the trajectory ``di`` holds now; the run stops as soon as every chunk met it (``True``: then the old end
    counts stand and ``c`` is meaningless). Each step is a few whole-array operations and no fancy indexing:
    the chosen dataset is a one-hot ``hot`` [K, B].
    """
    K, B = c.shape
    wc, kvec = w[:, None], np.arange(K, dtype=np.float64)
    first = starts.astype(np.float64)
    n, best, f = np.empty(B), np.empty(B), np.empty(B)
    e, hot, prod = np.empty((K, B)), np.empty((K, B)), np.empty((K, B))
    found, hit = np.empty(B, dtype=bool), np.empty(B, dtype=bool)
    for t in range(di.shape[0]):
        np.add(first, t, out=n)
        if t == 0:
            np.maximum(n, 1.0, out=n)  # megatron uses max(n, 1): sample 0 goes to the largest weight
        np.multiply(wc, n, out=e)  # the error w_k * n - c_k, rounded exactly as helpers.cpp rounds it
        np.subtract(e, c, out=e)
        np.maximum.reduce(e, axis=0, out=best)
        np.equal(e[0], best, out=found)
        hot[0] = found
        for k in range(1, K):  # the first maximum wins, as with megatron's strict '>'
            np.equal(e[k], best, out=hit)
            np.greater(hit, found, out=hit)
            np.logical_or(found, hit, out=found)
            hot[k] = hit
        np.multiply(hot, c, out=prod)
        np.add.reduce(prod, axis=0, out=f)
        dsi[t] = f  # the chosen dataset's count before this sample
        c += hot
        if old is not None:
            for k in range(K):
                old[k] += di[t] == k
        np.dot(kvec, hot, out=f)
        di[t] = f
        if old is not None and (t & 7) == 7 and np.array_equal(c, old):
            return True
    return False


Backend = Literal["auto", "c", "numpy"]


def _build(
    w: np.ndarray, size: int, start: int, c0: np.ndarray, backend: Backend = "auto"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dataset_index [L, B] int16, dataset_sample_index [L, B] int64, counts after) of the ``B * L >= size``
    samples from ``start``: sample ``start + b*L + t`` is entry ``[t, b]`` (chunk-major; ``B = 1`` from C)."""
    lib = blend_kernel.load() if backend != "numpy" else None
    if lib is not None:
        di, dsi, counts = blend_kernel.run(lib, w, size, start, c0)
        return di[:, None], dsi[:, None], counts
    if backend == "c":
        raise DataError("the C blend kernel is unavailable (no C compiler)")
    return _build_numpy(w, size, start, c0)


def _build_numpy(w: np.ndarray, size: int, start: int, c0: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_build` in numpy: chunks run side by side (see the module docstring)."""
    B = max(1, min(_MAX_CHUNKS, size // _MIN_CHUNK))
    L = -(-size // B)
    starts = start + np.arange(B, dtype=np.int64) * L
    guess = _guess_counts(w, starts)
    guess[:, 0] = c0
    di = np.empty((L, B), dtype=np.int16)
    dsi = np.empty((L, B), dtype=np.int64)
    end = guess.copy()
    _run(w, starts, end, di, dsi)
    while True:  # re-run every chunk that did not start where its predecessor ended
        bad = np.flatnonzero((end[:, :-1] != guess[:, 1:]).any(0)) + 1
        if len(bad) == 0:
            return di, dsi, end[:, -1].astype(np.int64)
        old = guess[:, bad].copy()
        guess[:, bad] = end[:, bad - 1]
        c, sub_di, sub_dsi = guess[:, bad].copy(), di[:, bad], dsi[:, bad]
        if not _run(w, starts[bad], c, sub_di, sub_dsi, old=old):
            end[:, bad] = c
        di[:, bad], dsi[:, bad] = sub_di, sub_dsi


def _flat(a: np.ndarray, size: int, tile: int = 64) -> np.ndarray:
    """Chunk-major [L, B] to sample order, transposed in tiles of ``tile`` steps (cache- and TLB-friendly)."""
    L, B = a.shape
    out = np.empty((B, L), dtype=a.dtype)
    for s in range(0, L, tile):
        out[:, s : s + tile] = a[s : s + tile].T
    return out.reshape(-1)[:size]


def blend_indices(
    weights, size: int, start: int = 0, counts: np.ndarray | None = None, backend: Backend = "auto"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dataset_index int16 [size], dataset_sample_index int64 [size], counts after) of blend samples
    ``start .. start + size - 1``, given the per-dataset ``counts`` before ``start`` (zeros at 0).

    ``weights`` are normalised here (megatron-core normalises them the same way). Identical to
    ``megatron.core.datasets.helpers.build_blending_indices``. ``backend``: ``c`` (the compiled loop), ``numpy``,
    or ``auto`` (C when it can be had).
    """
    w = normalize_weights(weights)
    c0 = np.zeros(len(w)) if counts is None else np.asarray(counts, dtype=np.float64).copy()
    if size <= 0:
        return np.zeros(0, np.int16), np.zeros(0, np.int64), c0.astype(np.int64)
    di, dsi, after = _build(w, size, start, c0, backend)
    if di.shape[1] == 1:  # from the C loop: already in sample order, exactly ``size`` long
        return di[:, 0], dsi[:, 0], after
    dataset_index = _flat(di, size)
    taken = np.bincount(dataset_index, minlength=len(w))
    return dataset_index, _flat(dsi, size), c0.astype(np.int64) + taken


class BlendIndex:
    """``(dataset, sample within it)`` of every global blend sample, built on demand and kept.

    The greedy's prefix does not depend on how far it is run, so growing the index (doubling, from the counts
    where it stopped) never changes a built entry: sample ``g``'s entry is a pure function of the weights and
    ``g``, however the index was grown. That is what lets a resumed run start at ``consumed_samples`` and read
    exactly the samples the uninterrupted run would have read.
    """

    def __init__(self, weights, min_grow: int = 1 << 16, backend: Backend = "auto") -> None:
        self.weights = normalize_weights(weights)
        self.min_grow, self.backend = min_grow, backend
        self._starts: list[int] = []  # first sample of each segment
        self._segments: list[tuple[np.ndarray, np.ndarray]] = []  # chunk-major [L, B] tables
        self._size = 0
        self._counts = np.zeros(len(self.weights))

    def __len__(self) -> int:
        """Samples built so far."""
        return self._size

    def _grow(self, need: int) -> None:
        size = max(need - self._size, self._size, self.min_grow)
        di, dsi, counts = _build(self.weights, size, self._size, self._counts, self.backend)
        self._starts.append(self._size)
        self._segments.append((di, dsi))
        self._size += di.size
        self._counts = counts.astype(np.float64)

    def __getitem__(self, g: int) -> tuple[int, int]:
        """(dataset, its sample index) of global blend sample ``g``."""
        g = int(g)
        if g < 0:
            raise IndexError(f"blend sample {g} is negative")
        if g >= self._size:
            self._grow(g + 1)
        s = int(np.searchsorted(self._starts, g, side="right")) - 1
        di, dsi = self._segments[s]
        b, t = divmod(g - self._starts[s], di.shape[0])
        return int(di[t, b]), int(dsi[t, b])


class BlendedDataset:
    """Samples of several :class:`~megasparse.data.dataset.PackedDataset` splits mixed by weight.

    Global sample ``g`` is sample ``j`` of dataset ``k`` for ``(k, j) = index[g]`` (Megatron's greedy blend),
    and dataset ``k`` reads its ``j``-th sample from its own seeded, epoch-by-epoch order. Token positions are
    offsets into the concatenation of the datasets' ``.bin`` files (dataset ``k`` starts at ``offsets[k]``), so
    per-token side data (one reference-loss sidecar per dataset, concatenated the same way) lines up with them.
    """

    def __init__(self, datasets, weights, name: str = "train", index: BlendIndex | None = None) -> None:
        if not datasets:
            raise DataError("a blend needs at least one dataset")
        self.datasets = list(datasets)
        self.index = index if index is not None else BlendIndex(weights)  # depends on the weights only: shareable
        self.weights = self.index.weights
        if len(self.weights) != len(self.datasets):
            raise DataError(f"a blend of {len(self.datasets)} datasets got {len(self.weights)} weights")
        self.name = name
        self.seq_length, self.eod_id = self.datasets[0].seq_length, self.datasets[0].eod_id
        self.prefixes = [d.indexed.prefix for d in self.datasets]
        sizes = [d.indexed.num_tokens for d in self.datasets]
        self.offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        """Start of each dataset's ``.bin`` in the concatenated token positions (one more: the total)."""
        self.num_tokens = sum(d.num_tokens for d in self.datasets)
        """Tokens in the datasets' split streams, EODs included."""

    def __len__(self) -> int:
        """Samples in one pass over every dataset's split (the stream itself is endless)."""
        return sum(len(d) for d in self.datasets)

    def locate(self, g: int) -> tuple[int, int]:
        """(dataset, sample of that dataset's endless stream) of global blend sample ``g``."""
        return self.index[g]

    def global_positions(self, g: int, seed: int | None = None) -> np.ndarray:
        """Concatenated ``.bin`` positions of global sample ``g``'s ``seq_length + 1`` tokens (-1: inserted EOD)."""
        k, j = self.locate(g)
        ds = self.datasets[k]
        pos = ds.positions(ds.global_index(j, seed))
        return np.where(pos >= 0, pos + self.offsets[k], -1)

    def tokens_at(self, pos: np.ndarray) -> torch.Tensor:
        """The tokens at concatenated positions ``pos`` (-1 reads as EOD)."""
        toks = np.full(len(pos), self.eod_id, dtype=np.int64)
        real = np.flatnonzero(pos >= 0)
        which = np.searchsorted(self.offsets, pos[real], side="right") - 1
        for k in np.unique(which):
            at = real[which == k]
            toks[at] = self.datasets[k].indexed.tokens[pos[at] - self.offsets[k]]
        return torch.from_numpy(toks)

    def global_sample(self, g: int, seed: int | None = None) -> torch.Tensor:
        """The ``g``-th sample of the endless blended stream."""
        return self.tokens_at(self.global_positions(g, seed))
