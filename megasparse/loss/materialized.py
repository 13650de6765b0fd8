"""Materialised baseline: logits = h @ W_shardᵀ, then megatron-style vocab-parallel cross-entropy.

Kept as the anchor CCE is measured against and as the ``impl=torch`` path. Collectives go through
``megasparse.parallel.vocab`` (comm wrappers), unlike megatron-core's own ``vocab_parallel_cross_entropy``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megasparse.parallel import vocab


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token lse − target logit + z·lse² from [n, V_local] logits; rows outside ``grad_rows`` get no gradient."""

    @staticmethod
    def forward(ctx, logits: Tensor, tgt: Tensor, n_valid: int, z_loss: float, grad_mask: Tensor, group) -> Tensor:
        x = logits.float()
        if n_valid < x.shape[1]:
            x = x.clone()
            x[:, n_valid:] = float("-inf")
        lse_l = torch.logsumexp(x, dim=1) if n_valid else torch.full_like(x[:, 0], float("-inf"))
        has_t = tgt >= 0
        t_l = torch.where(has_t, x.gather(1, tgt.clamp(min=0).unsqueeze(1)).squeeze(1), torch.zeros_like(lse_l))
        lse, t = vocab.merge_shard_stats(lse_l, t_l, group)
        ctx.save_for_backward(x, tgt, lse, grad_mask)
        ctx.z_loss, ctx.dtype = z_loss, logits.dtype
        return lse - t + z_loss * lse * lse

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, tgt, lse, grad_mask = ctx.saved_tensors
        g = torch.where(grad_mask, grad.float(), torch.zeros_like(grad, dtype=torch.float32))
        d = torch.exp(x - lse.unsqueeze(1)) * (g * (1 + 2 * ctx.z_loss * lse)).unsqueeze(1)
        has_t = tgt >= 0
        rows = has_t.nonzero().squeeze(1)
        d[rows, tgt[rows]] -= g[rows]
        return d.to(ctx.dtype), None, None, None, None, None


def materialized_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    vocab_start: int,
    n_valid: int,
    softcap: float | None,
    z_loss: float,
    group,
    sequence_parallel: bool,
    keep_idx: Tensor | None,
    ignore_index: int,
) -> Tensor:
    """The ``impl=torch`` path: dense [n, V_local] logits, gradient masked to kept, non-ignored rows."""
    h = vocab.GatherRows.apply(hidden, group, sequence_parallel)
    logits = h @ weight.T
    if softcap is not None:
        logits = softcap * torch.tanh(logits.float() / softcap)
    valid = targets != ignore_index
    t = targets - vocab_start
    t = torch.where(valid & (t >= 0) & (t < n_valid), t, torch.full_like(t, -1))
    grad_mask = valid.clone()
    if keep_idx is not None:
        kept = torch.zeros_like(valid)
        kept[keep_idx] = True
        grad_mask &= kept
    loss = VocabParallelCrossEntropy.apply(logits, t, n_valid, z_loss, grad_mask, group)
    return torch.where(valid, loss, torch.zeros_like(loss))
