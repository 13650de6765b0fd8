"""Compact gradients: a gradient that holds only the kept tokens' rows.

Autograd checks that a gradient has the shape of the forward output it belongs to, so a
[k, h] tensor cannot be returned where [s, b, h] was produced. ``CompactGrad`` is a wrapper
subclass that *reports* the full shape but stores only ``rows`` [k, h] and the flat row indices
``meta.idx`` [k] (rows of the output flattened to [-1, h], ascending). megasparse's own autograd
Functions unwrap it and run their backward GEMMs and collectives on the rows; autograd itself
only ever adds two of them (residual connections), which ``__torch_dispatch__`` handles without
densifying. Anything else densifies and counts it in ``DENSIFIED`` so tests can assert that
no O(tokens·hidden) tensor was built on the way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_map


class DensifyCounter:
    """How many compact gradients were densified in this process; ``reset()`` starts a new count."""

    def __init__(self) -> None:
        self.n = 0

    def add(self) -> None:
        self.n += 1

    def reset(self) -> None:
        self.n = 0


DENSIFIED = DensifyCounter()
"""The process's one counter: ``CompactGrad.dense`` adds to it, tests read it through ``densify_count()``."""


@dataclass(eq=False)
class KeepMeta:
    """Kept-row indices of one micro-batch in one layout, shared by every layer's gradient.

    ``seq_count`` and ``shards`` are what the selection fixed by shape alone (docs/decisions/0006): when they are
    set, every per-sequence and per-shard split below is computed on the device with sizes the host already
    knows, so the compact backward performs no host synchronisation."""

    idx: torch.Tensor
    """Flat row indices (ascending) into the [-1, h] view of the full tensor."""
    num_rows: int
    """Rows of the full tensor (s·b)."""
    batch: int = 1
    """b of the [s, b, h] layout the rows come from (row = pos·b + seq)."""
    seq_count: int | None = None
    """Kept rows of every sequence when the selection makes it equal for all (None: data-dependent)."""
    shards: int = 1
    """The kept rows fall evenly into this many contiguous equal slices of the rows (SP shards), each holding
    ``idx.numel() // shards``; with ``seq_count`` too, every (shard, sequence) cell holds ``seq_count // shards``."""
    _cache: dict = field(default_factory=dict)

    def global_meta(self) -> KeepMeta:
        """The TP-region (all SP shards) meta this shard's meta was split from; itself when not split."""
        return self._cache.get("sp_global", self)

    def shard_counts(self, tp: int) -> list[int] | None:
        """Kept rows per SP shard when fixed by the selection (None: needs the indices on the host)."""
        if self.shards == tp:
            return [self.idx.numel() // tp] * tp
        if tp == 1:
            return [self.idx.numel()]
        return None

    def per_sequence(self) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """[(seq, positions, which-compact-rows)] — computed once per micro-batch, reused by every layer."""
        if "per_seq" not in self._cache and self.batch == 1:  # one sequence: no host sync needed
            rows = torch.arange(self.idx.numel(), device=self.idx.device)
            self._cache["per_seq"] = [(0, self.idx, rows)]
        if "per_seq" not in self._cache and self.seq_count is not None:
            pos, sel = self._static_per_sequence()
            self._cache["per_seq"] = [(j, pos[j], sel[j]) for j in range(self.batch)]
        if "per_seq" not in self._cache:
            out = []
            seq = self.idx % self.batch
            for j in range(self.batch):
                sel = (seq == j).nonzero(as_tuple=True)[0]
                out.append((j, self.idx[sel] // self.batch, sel))
            self._cache["per_seq"] = out
        return self._cache["per_seq"]

    def _static_per_sequence(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[b, c] positions and compact-row indices when every sequence keeps c rows: one sort, no host sync."""
        b, c = self.batch, self.seq_count
        # rows are pos·b + seq and ascending; grouping by sequence keeps each group's positions ascending
        order = torch.argsort((self.idx % b) * self.num_rows + self.idx)
        return (self.idx.index_select(0, order) // b).view(b, c), order.view(b, c)

    def padded_per_sequence(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([b, m] kept positions, [b, m] compact-row indices), each sequence padded at the end to the longest.

        Padding repeats the sequence's last kept position (position 0 if it keeps none) and points at row K
        (one past the compact rows), which callers fill with zeros and drop. With a static ``seq_count`` there
        is no padding and no host sync. Memoised per micro-batch."""

        def build():
            if self.seq_count is not None:
                if self.batch == 1:
                    rows = torch.arange(self.idx.numel(), device=self.idx.device)
                    return self.idx.view(1, -1), rows.view(1, -1)
                return self._static_per_sequence()
            per = self.per_sequence()
            m = max(1, max(int(p.numel()) for _, p, _ in per))
            pos = torch.zeros(self.batch, m, dtype=torch.long, device=self.idx.device)
            sel = torch.full((self.batch, m), self.idx.numel(), dtype=torch.long, device=self.idx.device)
            for j, p, rows in per:
                n = int(p.numel())
                if n:
                    pos[j, :n], sel[j, :n] = p, rows
                    pos[j, n:] = p[-1]
            return pos, sel

        return self.derived("per_seq_padded", build)

    def derived(self, key: str, fn):
        """Memoise per-micro-batch derived metadata (e.g. the SP shard split) across layers."""
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]


class KeepHolder:
    """Kept rows of one micro-batch, filled by selection between the loss forward and the backward.

    The loss needs every token's value before selection, so the model's loss layers take this holder at
    forward time and read ``meta`` in backward (None: dense backward)."""

    meta: KeepMeta | None = None


class CompactGrad(torch.Tensor):
    """A gradient of full shape whose only non-zero rows are ``rows`` at ``meta.idx``."""

    rows: torch.Tensor
    meta: KeepMeta

    @staticmethod
    def __new__(cls, rows: torch.Tensor, meta: KeepMeta, full_shape: torch.Size | tuple[int, ...]):
        t = torch.Tensor._make_wrapper_subclass(
            cls, full_shape, dtype=rows.dtype, device=rows.device, requires_grad=False
        )
        t.rows = rows
        t.meta = meta
        return t

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"CompactGrad(full={tuple(self.shape)}, rows={tuple(self.rows.shape)})"

    def dense(self) -> torch.Tensor:
        """Materialise the full gradient (zeros outside kept rows). Counted: call only at boundaries."""
        DENSIFIED.add()
        h = self.rows.shape[-1]
        out = self.rows.new_zeros(self.meta.num_rows, h)
        out.index_copy_(0, self.meta.idx, self.rows)
        return out.view(self.shape)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func in (aten.add.Tensor, aten.add_.Tensor) and len(args) == 2:
            a, b = args
            if isinstance(a, CompactGrad) and isinstance(b, CompactGrad) and kwargs.get("alpha", 1) == 1:
                if a.meta is b.meta or torch.equal(a.meta.idx, b.meta.idx):
                    return CompactGrad(a.rows + b.rows, a.meta, a.shape)
        if func in (aten.detach.default, aten.alias.default):
            return CompactGrad(args[0].rows, args[0].meta, args[0].shape)

        def unwrap(x):
            return x.dense() if isinstance(x, CompactGrad) else x

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


def rows_of(t: torch.Tensor, meta: KeepMeta) -> torch.Tensor:
    """The kept rows of a saved full-size activation ``t`` (viewed as [-1, last])."""
    return t.reshape(-1, t.shape[-1]).index_select(0, meta.idx)


def densify_count() -> int:
    """Compact gradients densified so far in this process (tests assert the filtered backward never does)."""
    return DENSIFIED.n
