"""Materialised shard maths (``loss.impl: torch``): the megatron-style baseline behind the shared loss core.

Logits of this rank's vocabulary shard are formed whole ([rows, V_local] in fp32, the memory CCE avoids); the
backward recomputes them for the rows that get a gradient. Same contract as ``reference.torch_shard_forward`` /
``torch_shard_backward`` (``tgt`` is the column in this shard or -1; ``gs``/``gt`` scale the softmax and one-hot
parts), so the merge over TP, ignore_index, keep rows and the compact gradient are the core's (``core.py``) and
identical to CCE's. The core keeps ignored rows in this backend (gradient zeroed) instead of dropping them, so
the backward has no host synchronisation. No filtering: the logits exist anyway.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megasparse.ops.wgrad import accumulate_mm


def _logits(x: Tensor, w: Tensor, n_valid: int, softcap: float | None) -> tuple[Tensor, Tensor | None]:
    """fp32 logits [rows, V_local] (padding at -inf) and, with softcap, tanh(raw / softcap) for the backward."""
    logits = (x @ w.t()).float()
    t = None
    if softcap is not None:
        t = torch.tanh(logits / softcap)
        logits = softcap * t
    if n_valid < logits.shape[1]:
        logits[:, n_valid:] = float("-inf")
    return logits, t


def materialized_shard_forward(
    h: Tensor, w: Tensor, tgt: Tensor, n_valid: int, softcap: float | None = None
) -> tuple[Tensor, Tensor]:
    """(lse [n], target logit [n], 0 where the target is in another shard) from whole fp32 logits."""
    logits, _ = _logits(h, w, n_valid, softcap)
    lse = torch.logsumexp(logits, dim=1)
    picked = logits.gather(1, tgt.clamp(min=0)[:, None]).squeeze(1)
    return lse, torch.where(tgt >= 0, picked, torch.zeros_like(picked))


def materialized_shard_backward(
    h: Tensor,
    w: Tensor,
    tgt: Tensor,
    lse: Tensor,
    gs: Tensor,
    gt: Tensor,
    n_valid: int,
    softcap: float | None = None,
    dc_out: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """(dE [n, D], dC [V_local, D]) in w.dtype for dlogits = gs·softmax(logits − lse) − gt·onehot(tgt); with
    ``dc_out`` (fp32) dC is added into it by the GEMM itself and None is returned in its place."""
    logits, tanh = _logits(h, w, n_valid, softcap)
    d = torch.exp(logits - lse[:, None]) * gs[:, None]
    d.scatter_add_(1, tgt.clamp(min=0)[:, None], -(gt * (tgt >= 0))[:, None])  # one-hot, no boolean indexing
    if tanh is not None:
        d *= 1 - tanh * tanh
    d = d.to(w.dtype)
    if dc_out is None:
        return d @ w, d.t() @ h
    accumulate_mm(dc_out, d.t(), h)
    return d @ w, None
