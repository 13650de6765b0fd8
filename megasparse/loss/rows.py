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


_TARGET_CHUNK_ELEMS = 1 << 20  # [rows, D] temporaries of the target pass: 2 MB each in bf16


def add_target_term(
    h: Tensor, w: Tensor, tgt: Tensor, gt: Tensor, softcap: float | None, d_e: Tensor, d_c: Tensor
) -> None:
    """dE[r] −= c_r·W[t_r] and dW[t_r] −= c_r·h[r] for rows whose target lies in this slice (c_r = gt_r, times
    the softcap derivative at the target logit).

    The one-hot part of the logit gradient touches one column per row, so it runs row-owned and chunked
    instead of forcing every tile that holds a target through the kernels' gradient work (filtered mode of the
    tile and GEMM backends; exact mode forms it inside the tiles).
    """
    n, d = h.shape
    step = max(1, _TARGET_CHUNK_ELEMS // max(d, 1))
    for s in range(0, n, step):
        e = min(s + step, n)
        t = tgt[s:e]
        tc = t.clamp_min(0).long()
        coef = torch.where(t >= 0, gt[s:e].float(), 0.0)
        wt = w.index_select(0, tc)
        if softcap is not None:
            th = torch.tanh(torch.linalg.vecdot(h[s:e].float(), wt.float()) / softcap)
            coef = coef * (1 - th * th)
        d_e[s:e].addcmul_(coef.to(d_e.dtype).unsqueeze(1), wt, value=-1)
        d_c.index_add_(0, tc, h[s:e] * coef.to(d_c.dtype).unsqueeze(1), alpha=-1)
