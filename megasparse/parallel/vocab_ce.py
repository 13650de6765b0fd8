"""Materialised vocabulary-parallel cross-entropy (the megatron-core baseline, ``loss.impl: torch``).

Logits of this rank's vocabulary slice are formed in fp32, and the max, sum-exp and target logit are
combined over TP ranks. Under sequence parallelism the hidden states are all-gathered in and the
hidden-state gradient reduce-scattered out. With token filtering the backward recomputes nothing
for dropped rows: it takes the kept rows from ``keep.meta`` (filled in after selection, before
backward) and returns a compact gradient whose collective carries kept rows only.
"""

from __future__ import annotations

import torch

from megasparse.ops.compact import CompactGrad, KeepMeta, rows_of
from megasparse.parallel import comm, rows, state


class KeepHolder:
    """Filled by selection between the loss forward and the backward (None: dense backward)."""

    meta: KeepMeta | None = None


def _local_logits(x2d: torch.Tensor, w: torch.Tensor, vocab_start: int, vocab_size: int) -> torch.Tensor:
    logits = (x2d @ w.t()).float()
    pad_from = vocab_size - vocab_start
    if pad_from < logits.shape[1]:
        logits[:, max(pad_from, 0) :] = float("-inf")
    return logits


class VocabParallelCEFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        targets,
        vocab_start: int,
        vocab_size: int,
        sp: bool,
        dtype,
        keep: KeepHolder,
        ignore_index: int,
    ):
        group = state.tp_group()
        total = comm.all_gather(hidden, group, "tp", dim=0, region="loss.sp_gather") if sp else hidden
        x2d = total.reshape(-1, total.shape[-1])
        w = weight.to(dtype)
        logits = _local_logits(x2d, w, vocab_start, vocab_size)
        m = logits.max(dim=1).values
        comm.all_reduce(m, group, "tp", op=torch.distributed.ReduceOp.MAX, region="loss.max")
        se = torch.exp(logits - m[:, None]).sum(1)
        comm.all_reduce(se, group, "tp", region="loss.sumexp")
        lse = m + torch.log(se)
        local_t = targets - vocab_start
        in_shard = (local_t >= 0) & (local_t < w.shape[0])
        tl = logits.gather(1, torch.where(in_shard, local_t, 0)[:, None]).squeeze(1) * in_shard
        comm.all_reduce(tl, group, "tp", region="loss.target")
        valid = targets != ignore_index
        loss = torch.where(valid, lse - tl, torch.zeros_like(lse))
        ctx.save_for_backward(total, w, lse, targets)
        ctx.cfg = (vocab_start, vocab_size, sp, keep, ignore_index, hidden.shape, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, g):
        total, w, lse, targets = ctx.saved_tensors
        vocab_start, vocab_size, sp, keep, ignore_index, h_shape, wdtype = ctx.cfg
        lay = state.layout()
        group = state.tp_group()
        meta = keep.meta
        if meta is not None:
            x2d = rows_of(total, meta)
            lse, targets, g = lse[meta.idx], targets[meta.idx], g[meta.idx]
        else:
            x2d = total.reshape(-1, total.shape[-1])
        logits = _local_logits(x2d, w, vocab_start, vocab_size)
        p = torch.exp(logits - lse[:, None])
        local_t = targets - vocab_start
        in_shard = (local_t >= 0) & (local_t < w.shape[0])
        # softmax − one-hot, written without boolean indexing (no host sync in the backward)
        p.scatter_add_(1, torch.where(in_shard, local_t, 0)[:, None], -in_shard.to(p.dtype)[:, None])
        p *= torch.where(targets != ignore_index, g, torch.zeros_like(g))[:, None]
        d = p.to(w.dtype)
        dx = d @ w
        dw = (d.t() @ x2d).to(wdtype)
        if meta is not None:
            if sp:
                dx, local, work = rows.reduce_scatter_rows(dx, meta, group, lay.tp, lay.tp_rank, "loss.dgrad")
                if work is not None:
                    work.wait()
                return CompactGrad(dx, local, h_shape), dw, None, None, None, None, None, None, None
            comm.all_reduce(dx, group, "tp", region="loss.dgrad")
            return CompactGrad(dx, meta, h_shape), dw, None, None, None, None, None, None, None
        dx = dx.view(*total.shape)
        if sp:
            dx = comm.reduce_scatter(dx, group, "tp", region="loss.dgrad")
        else:
            comm.all_reduce(dx, group, "tp", region="loss.dgrad")
        return dx, dw, None, None, None, None, None, None, None


def vocab_parallel_ce(
    hidden,
    weight,
    targets,
    *,
    vocab_start: int,
    vocab_size: int,
    sequence_parallel: bool,
    compute_dtype: torch.dtype,
    keep: KeepHolder | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Per-token loss [s·b] (fp32) of hidden [s(/tp), b, h] against global-row targets [s·b]."""
    return VocabParallelCEFn.apply(
        hidden,
        weight,
        targets,
        vocab_start,
        vocab_size,
        sequence_parallel,
        compute_dtype,
        keep or KeepHolder(),
        ignore_index,
    )
