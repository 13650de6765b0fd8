"""Pure-torch reference of the per-shard CCE pieces, chunked over the vocabulary.

Same contract as the Triton launchers in ``cce.py`` (the kernels are tested against it), and the
path ``impl=cce`` takes on CPU: it never holds more than [rows, chunk] logits, so it runs at real
vocabulary sizes on a laptop. Arithmetic is in fp32 (fp64 when the inputs are fp64).

Conventions shared with the kernels:
  * ``tgt`` holds the target's column *in this shard* or -1 when the target lives elsewhere;
  * only the first ``n_valid`` rows of ``w`` are real vocabulary (the rest is TP padding and
    never enters the log-sum-exp);
  * ``gs``/``gt`` scale the softmax and the one-hot parts of the logit gradient per row, so the
    caller folds in the incoming gradient and the z-loss factor.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MAX_CHUNK_ELEMS = 1 << 24  # [rows, chunk] fp32 logits: at most 64 MB


def _acc_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _chunk(n_rows: int, n_cols: int, chunk: int | None) -> int:
    if chunk is not None:
        return max(1, chunk)
    return max(256, min(n_cols, _MAX_CHUNK_ELEMS // max(n_rows, 1)))


def _capped(logits: Tensor, softcap: float | None) -> tuple[Tensor, Tensor | None]:
    if softcap is None:
        return logits, None
    t = torch.tanh(logits / softcap)
    return softcap * t, t


def torch_shard_forward(
    h: Tensor,
    w: Tensor,
    tgt: Tensor,
    n_valid: int,
    softcap: float | None = None,
    chunk: int | None = None,
) -> tuple[Tensor, Tensor]:
    """(lse [n], target logit [n] (0 where the target is not in this shard))."""
    acc = _acc_dtype(h)
    n = h.shape[0]
    lse = torch.full((n,), float("-inf"), dtype=acc, device=h.device)
    tlogit = torch.zeros(n, dtype=acc, device=h.device)
    step = _chunk(n, n_valid, chunk)
    for s in range(0, n_valid, step):
        e = min(s + step, n_valid)
        logits, _ = _capped((h @ w[s:e].T).to(acc), softcap)
        lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=1))
        inside = (tgt >= s) & (tgt < e)
        picked = logits.gather(1, (tgt - s).clamp(0, e - s - 1).unsqueeze(1)).squeeze(1)
        tlogit += torch.where(inside, picked, torch.zeros_like(picked))
    return lse, tlogit


def torch_shard_backward(
    h: Tensor,
    w: Tensor,
    tgt: Tensor,
    lse: Tensor,
    gs: Tensor,
    gt: Tensor,
    n_valid: int,
    softcap: float | None = None,
    filter_eps: float | None = None,
    perm: Tensor | None = None,
    chunk: int | None = None,
) -> tuple[Tensor, Tensor]:
    """(dE [n, D] in h.dtype, dC [V_local, D] in w.dtype) for dlogits = gs·softmax − gt·onehot.

    ``filter_eps`` drops softmax entries below it (elementwise here; the kernels drop whole blocks,
    which keeps a superset of these entries). ``perm`` is the vocabulary order to walk in.
    """
    acc = _acc_dtype(h)
    n = h.shape[0]
    d_e = torch.zeros(n, h.shape[1], dtype=acc, device=h.device)
    d_c = torch.zeros(w.shape[0], w.shape[1], dtype=acc, device=h.device)
    h_acc = h.to(acc)
    lse = lse.to(acc)
    gs = gs.to(acc).unsqueeze(1)
    gt = gt.to(acc).unsqueeze(1)
    step = _chunk(n, n_valid, chunk)
    for s in range(0, n_valid, step):
        e = min(s + step, n_valid)
        cols = perm[s:e] if perm is not None else torch.arange(s, e, device=h.device)
        wc = w.index_select(0, cols) if perm is not None else w[s:e]
        logits, t = _capped((h @ wc.T).to(acc), softcap)
        p = torch.exp(logits - lse.unsqueeze(1))
        if filter_eps is not None:
            p = torch.where(p < filter_eps, torch.zeros_like(p), p)
        onehot = tgt.unsqueeze(1) == cols.unsqueeze(0)
        g = gs * p - torch.where(onehot, gt, torch.zeros_like(p))
        if t is not None:
            g = g * (1 - t * t)
        d_e += g @ wc.to(acc)
        d_c.index_copy_(0, cols, g.T @ h_acc)
    return d_e.to(h.dtype), d_c.to(w.dtype)
