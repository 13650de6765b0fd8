"""Materialised vocabulary-parallel cross-entropy: the megatron-style baseline (``loss.impl: torch``).

Logits of this rank's vocabulary shard are formed whole ([rows, V_local] in fp32, the memory CCE avoids), each
shard's log-sum-exp and target logit are merged over TP like the CCE path (one all-gather of [2, n], see
``parallel/vocab.py``), and the backward recomputes the logits of the rows that get a gradient. Serves both the
trainer (a ``KeepHolder`` filled by selection after the forward; compact dE out) and direct callers (``keep_idx``
known up front; dense dE out). Softcap, z-loss, ignore_index and vocabulary padding behave as in ``cce.py``.
No host synchronisation in the backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megasparse.loss.cce import CCEOptions, local_targets
from megasparse.parallel import comm, vocab


def _logits(x: Tensor, w: Tensor, opt: CCEOptions) -> tuple[Tensor, Tensor | None]:
    """fp32 logits [rows, V_local] (padding at -inf) and, with softcap, tanh(raw / softcap) for the backward."""
    logits = (x @ w.t()).float()
    t = None
    if opt.softcap is not None:
        t = torch.tanh(logits / opt.softcap)
        logits = opt.softcap * t
    if opt.n_valid < logits.shape[1]:
        logits[:, opt.n_valid :] = float("-inf")
    return logits, t


def _local_targets(targets: Tensor, opt: CCEOptions) -> tuple[Tensor, Tensor]:
    """(column in this shard, clamped to 0 where the target is elsewhere; whether it is in this shard)."""
    t = local_targets(targets, opt.vocab_start, opt.n_valid)
    return t.clamp(min=0), t >= 0


class MaterializedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, keep, group, opt: CCEOptions):
        total = vocab.gather_rows(hidden, group, opt.sequence_parallel)
        x = total.reshape(-1, total.shape[-1])
        logits, _ = _logits(x, weight, opt)
        lse_l = torch.logsumexp(logits, dim=1)
        t, inside = _local_targets(targets, opt)
        picked = logits.gather(1, t[:, None]).squeeze(1)
        tl = torch.where(inside, picked, torch.zeros_like(picked))
        lse, tl = vocab.merge_shard_stats(lse_l, tl, group)
        loss = lse - tl + opt.z_loss * lse * lse if opt.z_loss else lse - tl
        loss = torch.where(targets != opt.ignore_index, loss, torch.zeros_like(loss))
        keep_idx = keep if isinstance(keep, Tensor) else None
        ctx.save_for_backward(x, weight, targets, lse, keep_idx)
        ctx.keep, ctx.group, ctx.opt, ctx.h_shape, ctx.n = keep, group, opt, hidden.shape, x.shape[0]
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, w, targets, lse, keep_idx = ctx.saved_tensors
        opt: CCEOptions = ctx.opt
        meta = getattr(ctx.keep, "meta", None)
        rows = meta.idx if meta is not None else keep_idx
        g = grad.float()
        if rows is not None:
            x, targets, lse, g = x.index_select(0, rows), targets[rows], lse[rows], g[rows]
        g = torch.where(targets != opt.ignore_index, g, torch.zeros_like(g))
        logits, tanh = _logits(x, w, opt)
        gs = g * (1 + 2 * opt.z_loss * lse) if opt.z_loss else g
        d = torch.exp(logits - lse[:, None]) * gs[:, None]
        t, inside = _local_targets(targets, opt)
        d.scatter_add_(1, t[:, None], -(g * inside)[:, None])  # softmax − one-hot, no boolean indexing
        if tanh is not None:
            d *= 1 - tanh * tanh
        d = d.to(w.dtype)
        dx, dw = d @ w, d.t() @ x
        sp = opt.sequence_parallel
        if meta is not None:  # the trainer's Collider path: kept rows travel, a compact gradient goes back
            return vocab.compact_kept_grad(dx, rows, meta, ctx.group, sp, ctx.h_shape), dw, None, None, None, None
        with comm.phase("backward"):
            dh = vocab.reduce_kept_grad(dx, rows, ctx.n, ctx.group, sp)
        return dh.view(ctx.h_shape), dw, None, None, None, None


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
    keep_idx,
    ignore_index: int,
) -> Tensor:
    """Per-token loss [n] fp32; ``keep_idx`` is an index tensor, a KeepHolder filled before backward, or None."""
    opt = CCEOptions(
        n_valid=n_valid, vocab_start=vocab_start, softcap=softcap, z_loss=z_loss, ignore_index=ignore_index,
        sequence_parallel=sequence_parallel,
    )  # fmt: skip
    return MaterializedCE.apply(hidden, weight, targets, keep_idx, group, opt)
