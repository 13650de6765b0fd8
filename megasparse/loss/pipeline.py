"""Output-layer vocabulary sharded over the pipeline ranks too (``loss.vocab_over_pp``).

Every (pp, tp) rank holds a [V_pad/(tp·pp), h] slice of the output weight, slice index
``pp_rank·tp + tp_rank``, cut from the same full matrix as a single-stage run. Per micro-batch:

* forward: the last stage's final-norm output (SP shards gathered over TP) is broadcast over the PP
  group; every rank computes its slice's partial (lse, target logit) and ONE all-gather of [2, n]
  fp32 over the model-parallel group (tp × pp) merges them in rank order, so every rank holds the
  same per-token lse. The last stage turns it into the per-token loss (selection happens there).
* backward: the last stage broadcasts the per-token loss gradient [n] over PP; every rank computes
  its slice's dC (stays local: the weight gradient of its own slice) and its partial dE [n, h]; the
  partials are summed over the model-parallel group and the last stage feeds the sum (its SP shard
  of it) into the final-norm backward.

Scheduling: the stages run in lock step (``pipeline.lockstep``): in each period every stage does one
forward, the loss slice of the micro-batch the last stage is on (the last stage's own slice is inside
its forward/backward), then one backward, so the slices meet without waiting for each other. See
docs/decisions/0800-vocab-over-pp-schedule.md for why not 1F1B and what it costs in memory.

The slice maths is the loss core's (``core.slice_stats`` / ``slice_grads``): Triton CCE on CUDA with
``loss.impl=cce``, the chunked torch reference otherwise (``impl=materialized`` uses it here: its slices are small).
The collectives are ``megasparse.parallel.vocab_pp_comm``'s; the input embedding's slices are
``megasparse.parallel.embedding_pp.PPEmbedding``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megasparse.loss.config import LossConfig, filter_threshold, resolve_impl
from megasparse.loss.core import KeepSpec, LossOptions, master_grad, slice_grads, slice_stats, token_loss
from megasparse.loss.rows import rows_to_all
from megasparse.ops.compact import CompactGrad
from megasparse.ops.wgrad import grad_buffer
from megasparse.parallel import comm, rows, state
from megasparse.parallel.embedding_pp import stage_rows
from megasparse.parallel.pipeline import catch_grad
from megasparse.parallel.vocab_pp_comm import broadcast_from_last, gather_tp_rows, merge_slice_stats, sum_slice_dgrad

__all__ = ["FLOPS", "VocabOverPP", "VocabPPPeer", "reset_flops", "slice_range", "stage_rows", "vocab_pp_loss"]


@dataclass
class FlopCounter:
    """Matmul FLOPs of this rank's loss slices since the last ``reset`` (2·rows·cols·h forward, 4·rows·cols·h
    backward, real vocabulary columns only): tests and the planner compare stages with them."""

    forward: int = 0
    backward: int = 0

    def reset(self) -> None:
        self.forward = self.backward = 0

    def keys(self):  # ``dict(FLOPS)`` gives {"forward": .., "backward": ..}
        return ("forward", "backward")

    def __getitem__(self, key: str) -> int:
        return getattr(self, key)


FLOPS = FlopCounter()
"""This process's counter (one loss layer per process)."""


def reset_flops() -> None:
    FLOPS.reset()


def slice_range(vocab_padded: int) -> tuple[int, int]:
    """(vocab_start, rows) of this rank's output-weight slice: slice index pp_rank·tp + tp_rank."""
    lay = state.layout()
    per = vocab_padded // (lay.tp * lay.pp)
    return (lay.pp_rank * lay.tp + lay.tp_rank) * per, per


class _Slice:
    """One rank's slice of the output layer: the loss core on it, with the model-parallel merge and dE sum."""

    def __init__(
        self,
        cfg: LossConfig,
        vocab_start: int,
        vocab_size: int,
        width: int,
        dtype: torch.dtype,
        ignore_index: int,
        rows: int,
    ):
        self.dtype = dtype
        impl, _ = resolve_impl(cfg, rows, width)
        cce = impl == "cce"
        self.opt = LossOptions(
            n_valid=max(0, min(width, vocab_size - vocab_start)), vocab_start=vocab_start, softcap=cfg.softcap,
            z_loss=cfg.z_loss, filter_eps=filter_threshold(cfg.filter_eps, dtype) if cce else None,
            sort_vocab=cfg.sort_vocab, accum_fp32=cfg.grad_accum_fp32, scratch_bytes=cfg.scratch_bytes,
            ignore_index=ignore_index, backend=cfg.backend if cce else "reference",
        )  # fmt: skip

    def forward(self, h: Tensor, w: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """Merged per-token (lse, target logit) over every slice, identical on every rank (0 on ignored rows)."""
        lse, tgt, n_rows = slice_stats(h, w, targets, self.opt, merge_slice_stats)
        FLOPS.forward += 2 * n_rows * self.opt.n_valid * h.shape[1]
        return lse, tgt

    def backward(
        self, h: Tensor, w: Tensor, targets: Tensor, lse: Tensor, g: Tensor, dc_out: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """(dE summed over every slice [n, h], this slice's dC) for per-token loss gradient ``g``; with ``dc_out``
        (the weight's fp32 bucket slice) dC is added there and returned as None."""
        d_e, d_c, sub = slice_grads(h, w, targets, lse, g, self.opt, dc_out)
        FLOPS.backward += 4 * d_e.shape[0] * self.opt.n_valid * h.shape[1]
        sum_slice_dgrad(d_e)
        return rows_to_all(d_e, sub, h.shape[0]), d_c


def _kept_backward(
    sl: _Slice, h: Tensor, w: Tensor, targets: Tensor, lse: Tensor, idx: Tensor, g: Tensor, dc_out: Tensor | None
):
    """Collider: every slice's backward on the kept rows only; the dE all-reduce carries [k, h]."""
    return sl.backward(h.index_select(0, idx), w, targets.index_select(0, idx), lse.index_select(0, idx), g, dc_out)


class _LastStageLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, master: Tensor, operand: Tensor, targets: Tensor, sl: _Slice, sp: bool, keep):
        """Reads ``operand`` (the compute-dtype weight); dC goes to ``master``, into its bucket slice if it has one."""
        weight = operand
        h_shape = hidden.shape
        h = hidden.reshape(-1, h_shape[-1]).to(sl.dtype)
        if sp:
            h = gather_tp_rows(h)
        h = h.contiguous()
        targets = targets.reshape(-1)
        if h.shape[0] != targets.numel():
            raise ValueError(f"loss: {h.shape[0]} hidden rows (gathered over TP) but {targets.numel()} targets")
        broadcast_from_last(h)
        lse, tgt = sl.forward(h, weight, targets)
        valid = targets != sl.opt.ignore_index
        loss = torch.where(valid, token_loss(lse, tgt, sl.opt.z_loss), torch.zeros_like(lse))
        ctx.save_for_backward(h, weight, targets, lse, valid)
        ctx.sl, ctx.sp, ctx.h_shape, ctx.keep, ctx.master = sl, sp, h_shape, keep, master
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor):
        h, weight, targets, lse, valid = ctx.saved_tensors
        g = torch.where(valid, grad.float(), torch.zeros_like(lse)).contiguous()
        meta = ctx.keep.meta
        lay = state.layout()
        bucket = grad_buffer(ctx.master)
        with comm.phase("backward"):
            if meta is not None:  # collider: kept rows only, their indices travel with the gradient
                idx = meta.idx.contiguous()
                broadcast_from_last(idx)
                g = g.index_select(0, idx)
                broadcast_from_last(g)
                d_rows, d_c = _kept_backward(ctx.sl, h, weight, targets, lse, idx, g, bucket)
                if ctx.sp:
                    local, counts = rows.sp_split(meta, lay.tp, lay.tp_rank)
                    start = sum(counts[: lay.tp_rank])
                    d_rows, meta = d_rows[start : start + counts[lay.tp_rank]], local
                return (
                    CompactGrad(d_rows, meta, ctx.h_shape),
                    master_grad(d_c, ctx.master),
                    None,
                    None,
                    None,
                    None,
                    None,
                )
            broadcast_from_last(g)
            d_e, d_c = ctx.sl.backward(h, weight, targets, lse, g, bucket)
        if ctx.sp:
            d_e = d_e.chunk(lay.tp)[lay.tp_rank]
        return d_e.reshape(ctx.h_shape), master_grad(d_c, ctx.master), None, None, None, None, None


def vocab_pp_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    cfg: LossConfig,
    *,
    vocab_start: int,
    vocab_size: int,
    sequence_parallel: bool = False,
    ignore_index: int = -100,
    keep=None,
    operand: Tensor | None = None,
) -> Tensor:
    """Last stage: per-token loss [n] fp32 with the vocabulary spread over every (pp, tp) rank.

    ``hidden`` is [s(/tp), b, h] (sequence shard under SP); ``weight`` is this rank's slice (the fp32 master: dC
    is added into its bucket slice when it has one), read as ``operand`` (its compute-dtype cast when not given).
    Every other pipeline rank must run ``VocabPPPeer.step`` for the same micro-batch.
    ``keep``: a KeepHolder (or ``KeepSpec``) whose ``meta`` selection fills before backward (compact backward).
    """
    operand = weight if operand is None else operand
    sl = _Slice(cfg, vocab_start, vocab_size, weight.shape[0], operand.dtype, ignore_index, targets.numel())
    return _LastStageLoss.apply(hidden, weight, operand.detach(), targets, sl, sequence_parallel, KeepSpec.of(keep))


class VocabPPPeer:
    """A non-last pipeline rank's part of the output layer: its slice's loss pieces and weight gradient."""

    def __init__(
        self,
        weight: torch.nn.Parameter,
        cfg: LossConfig,
        *,
        vocab_start: int,
        vocab_size: int,
        rows: int,
        compute_dtype: torch.dtype,
        ignore_index: int = -100,
        kept_rows: int | None = None,
    ):
        """``kept_rows``: the static kept count per micro-batch under collider (None: dense backward)."""
        self.weight = weight
        self.rows = rows
        self.kept_rows = kept_rows
        self.ignore_index = ignore_index
        self.sl = _Slice(cfg, vocab_start, vocab_size, weight.shape[0], compute_dtype, ignore_index, rows)

    def step(self, targets: Tensor, train: bool) -> None:
        """Join the last stage's loss of one micro-batch (forward, and with ``train`` its backward)."""
        w = self.weight.detach().to(self.sl.dtype)
        h = torch.empty(self.rows, w.shape[1], dtype=self.sl.dtype, device=w.device)
        targets = targets.reshape(-1)
        with comm.phase("forward"):
            broadcast_from_last(h)
            lse, _ = self.sl.forward(h, w, targets)
        if not train:
            return
        bucket = grad_buffer(self.weight)
        with comm.phase("backward"):
            if self.kept_rows is not None:
                idx = torch.empty(self.kept_rows, dtype=torch.long, device=w.device)
                broadcast_from_last(idx)
                g = torch.empty(self.kept_rows, dtype=lse.dtype, device=w.device)
                broadcast_from_last(g)
                _, d_c = _kept_backward(self.sl, h, w, targets, lse, idx, g, bucket)
            else:
                g = torch.empty_like(lse)
                broadcast_from_last(g)
                _, d_c = self.sl.backward(h, w, targets, lse, g, bucket)
        if d_c is None:  # added into the bucket slice by the dC GEMMs (ops/wgrad.py)
            return
        # this runs while stage 0 holds its most in-flight activations (lock step): free the compute-dtype
        # weight copy first and add in place, so no [V_slice, h] fp32 temporary joins the peak
        del w, h
        if self.weight.grad is None:
            self.weight.grad = torch.zeros_like(self.weight)
        self.weight.grad.add_(d_c)


class VocabOverPP:
    """``loss.vocab_over_pp`` as one trainer component: the hooks a step calls around its micro-batches.

    * ``begin(batches, train)``: under ``loss.embedding_over_pp`` every stage looks the step's inputs up at once
      (``PPEmbedding.lookup_all``); the first stage's gradients of them are caught for ``finish``.
    * ``input(i)``: the first stage's embedded input of micro-batch i (None: the stage embeds the ids itself).
    * ``slot(batches, train)``: what a non-last stage runs in the lock-step schedule's slot for micro-batch k (its
      slice of the last stage's loss, ``VocabPPPeer.step``), or None on the last stage (its slice is in its loss).
    * ``finish(train)``: the input embedding slices' backward over the whole step (``PPEmbedding.backward_all``).
    * ``capture_blocker()``: the slices meet in collectives the eager schedule orders, so nothing is captured.
    """

    def __init__(self, model, cfg: LossConfig, *, vocab: int, rows: int, dtype: torch.dtype, kept_rows: int | None):
        """``model``: this rank's stage (with ``vocab_pp``); ``rows``: tokens per micro-batch; ``kept_rows``: the
        static kept count under collider (None: dense backward)."""
        self.embedding = model.embedding if model.embedding_pp else None
        self.peer = None
        if not state.layout().is_last_stage:
            kw = dict(vocab_start=model.vocab_start, vocab_size=vocab, rows=rows, compute_dtype=dtype)
            self.peer = VocabPPPeer(model.output_weight, cfg, kept_rows=kept_rows, **kw)
        self.inputs: list[Tensor] | None = None
        self.caught: list[dict] = []

    @classmethod
    def capture_blocker(cls) -> str:
        return "loss.vocab_over_pp"

    def begin(self, batches: list, train: bool) -> None:
        self.inputs, self.caught = None, [{} for _ in batches]
        if self.embedding is None:
            return
        self.inputs = self.embedding.lookup_all([b.tokens[:, :-1].t() for b in batches], requires_grad=train)
        if self.inputs is not None and train:
            self.inputs = [catch_grad(x, c) for x, c in zip(self.inputs, self.caught)]

    def input(self, i: int) -> Tensor | None:
        return None if self.inputs is None else self.inputs[i]

    def slot(self, batches: list, train: bool):
        peer = self.peer
        return None if peer is None else lambda k: peer.step(batches[k].targets, train=train)

    def finish(self, train: bool) -> None:
        if train and self.embedding is not None:
            self.embedding.backward_all(None if self.inputs is None else [c.get("grad") for c in self.caught])
        self.inputs = None
