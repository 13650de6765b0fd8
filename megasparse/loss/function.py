"""The vocabulary-parallel loss as one autograd Function over a TP-sharded vocabulary (``loss.impl=cce``/``torch``).

Forward: rows of the whole TP region (all-gathered under SP), this shard's statistics, ONE all-gather of [2, n]
merging them (``parallel/vocab.py``), the per-token loss. Backward: the rows a ``KeepSpec`` names (∩ valid
targets), this shard's (dE, dC), and the dE collective carrying those rows only: dense, or a compact gradient
of the kept rows for the trainer's filtered backward (kept rows with an ignored target get zero rows).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megasparse.loss.core import KeepSpec, LossOptions, master_grad, slice_grads, slice_stats, token_loss
from megasparse.loss.rows import rows_or_all, rows_to_all
from megasparse.ops.wgrad import grad_buffer
from megasparse.parallel import comm, vocab


def check_rows(hidden: Tensor, targets: Tensor, group, sequence_parallel: bool) -> None:
    """One clear line when the hidden rows of the TP region and the targets disagree (before any collective)."""
    tp = vocab.tp_size(group) if sequence_parallel else 1
    rows = hidden.shape[0] * tp
    if rows != targets.numel():
        sp = f" × tp {tp} (sequence parallel)" if sequence_parallel else ""
        raise ValueError(f"loss: {hidden.shape[0]} hidden rows{sp} = {rows} rows but {targets.numel()} targets")


def _sorted_rows(idx: Tensor, n: int) -> Tensor:
    """Ascending, duplicate-free row indices (the dE collective's contract)."""
    mask = torch.zeros(n, dtype=torch.bool, device=idx.device)
    mask[idx] = True
    return mask.nonzero().squeeze(1)


class VocabParallelLoss(torch.autograd.Function):
    """Per-token loss lse − target logit + z·lse² over a TP-sharded vocabulary; the maths is ``opt.backend``'s."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        keep: KeepSpec,
        group,
        opt: LossOptions,
        operand: Tensor | None = None,
    ):
        """``operand``: ``weight``'s compute-dtype copy (the model's ``ComputeCopy``); the forward reads it and the
        weight gradient goes to ``weight`` (the fp32 master), into its bucket slice when it has one."""
        master = weight if operand is not None else None
        weight = weight if operand is None else operand
        h_shape = hidden.shape  # [s, b, h] from the model, [n, h] from direct callers
        hidden = hidden.reshape(-1, h_shape[-1])
        check_rows(hidden, targets, group, opt.sequence_parallel)
        h_full = vocab.gather_rows(hidden, group, opt.sequence_parallel)
        lse, tgt, _ = slice_stats(h_full, weight, targets, opt, lambda a, b: vocab.merge_shard_stats(a, b, group))
        loss = token_loss(lse, tgt, opt.z_loss)
        loss = torch.where(targets != opt.ignore_index, loss, torch.zeros_like(loss))
        ctx.save_for_backward(h_full, weight, targets, lse, keep.idx)
        ctx.keep, ctx.group, ctx.opt, ctx.h_shape, ctx.master = keep, group, opt, h_shape, master
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor):
        h_full, weight, targets, lse, keep_idx = ctx.saved_tensors
        opt: LossOptions = ctx.opt
        n = targets.numel()
        meta = ctx.keep.meta  # the trainer's Collider path: kept rows chosen after the forward, compact dE out
        keep = meta.idx if meta is not None else (_sorted_rows(keep_idx, n) if keep_idx is not None else None)
        sel = (h_full, targets, lse, grad.float())
        h_k, t_k, lse_k, g_k = (rows_or_all(t, keep) for t in sel)
        master = ctx.master
        bucket = grad_buffer(master)  # dC straight into the master's fp32 bucket slice (ops/wgrad.py)
        d_e, d_c, sub = slice_grads(h_k, weight, t_k, lse_k, g_k, opt, dc_out=bucket)
        d_c = master_grad(d_c, master)
        if meta is not None:
            d_e = rows_to_all(d_e, sub, keep.numel())  # kept rows with an ignored target: zero rows
            d_h = vocab.compact_kept_grad(d_e, meta, ctx.group, opt.sequence_parallel, ctx.h_shape)
            return d_h, d_c, None, None, None, None, None
        rows = keep if sub is None else (sub if keep is None else keep.index_select(0, sub))
        with comm.phase("backward"):
            d_h = vocab.reduce_kept_grad(d_e, rows, n, ctx.group, opt.sequence_parallel)
        return d_h.view(ctx.h_shape), d_c, None, None, None, None, None
