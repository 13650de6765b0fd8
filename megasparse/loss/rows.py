"""Row bookkeeping shared by every output loss: which rows count, and each target's column in a vocabulary slice."""

from __future__ import annotations

import torch
from torch import Tensor


def rows_or_all(x: Tensor, rows: Tensor | None) -> Tensor:
    """``x`` restricted to ``rows`` (``x`` itself when rows is None)."""
    return x if rows is None else x.index_select(0, rows)


def rows_to_all(x: Tensor, rows: Tensor | None, n: int) -> Tensor:
    """Inverse of selecting ``rows``: ``x`` scattered into n rows of zeros (``x`` itself when rows is None)."""
    return x if rows is None else x.new_zeros(n, *x.shape[1:]).index_copy_(0, rows, x)


def valid_rows(targets: Tensor, ignore_index: int) -> Tensor | None:
    """Indices of the rows whose target is not ``ignore_index``; None when all are (the common case, no copy).

    Callers drop the others before any kernel or collective (the paper's Appendix A)."""
    valid = targets != ignore_index
    return None if bool(valid.all()) else valid.nonzero().squeeze(1)


def local_targets(targets: Tensor, start: int, n_valid: int) -> Tensor:
    """Each target's column in the vocabulary slice [start, start + n_valid), -1 where it lies elsewhere."""
    t = targets - start
    return torch.where((t >= 0) & (t < n_valid), t, torch.full_like(t, -1))
