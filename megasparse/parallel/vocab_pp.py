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

Input embedding (``loss.embedding_over_pp``, on by default): sliced the same way, but batched per
step instead of per micro-batch, because a lookup depends on nothing but the token ids, which every
rank has. At the start of a step every rank looks up its slice for all micro-batches and ONE
all-reduce over the model-parallel group assembles the first stage's inputs; after the pipeline
drains the first stage's input gradients of all micro-batches go back the same way (one all-reduce)
and every rank scatter-adds its slice's rows. Both sit outside the pipeline schedule, which
therefore needs no extra rendezvous; the price is a [micro-batches, s, b, h] buffer and two collectives per step
on the critical path (docs/decisions/0801-embedding-over-pp.md).

The slice maths is ``megasparse.loss.shard_forward`` / ``shard_backward``: Triton CCE on CUDA with
``loss.impl=cce``, the chunked torch reference otherwise (``impl=torch`` always uses it).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from megasparse.loss import shard_backward, shard_forward, vocab_order
from megasparse.loss.cce import local_targets, rows_to_all, valid_rows
from megasparse.loss.config import LossConfig
from megasparse.ops.compact import CompactGrad
from megasparse.parallel import comm, rows, state
from megasparse.parallel.layers import padded_vocab_init, vocab_slice_grad, vocab_slice_lookup

REGION = "loss.vocab_pp"

FLOPS: dict[str, int] = {"forward": 0, "backward": 0}
"""Matmul FLOPs of this rank's loss slices since the last ``reset_flops`` (2·rows·cols·h forward,
4·rows·cols·h backward, real vocabulary columns only): tests and the planner compare stages with them."""


def reset_flops() -> None:
    FLOPS["forward"] = FLOPS["backward"] = 0


def slice_range(vocab_padded: int) -> tuple[int, int]:
    """(vocab_start, rows) of this rank's output-weight slice: slice index pp_rank·tp + tp_rank."""
    lay = state.layout()
    per = vocab_padded // (lay.tp * lay.pp)
    return (lay.pp_rank * lay.tp + lay.tp_rank) * per, per


def stage_rows(vocab_padded: int, shares: list[float], unit: int) -> list[int]:
    """Rows per pipeline stage for ``shares`` of a vocabulary matrix, whole ``unit``s, summing to vocab_padded."""
    units = vocab_padded // unit
    acc, bounds = 0.0, [0]
    for s in shares:
        acc += s
        bounds.append(min(units, int(round(acc * units))))
    bounds[-1] = units
    return [(b - a) * unit for a, b in zip(bounds, bounds[1:])]


class _Slice:
    """One rank's slice of the output layer and the collectives shared by the last stage and its peers."""

    def __init__(
        self, cfg: LossConfig, vocab_start: int, vocab_size: int, width: int, dtype: torch.dtype, ignore_index: int
    ):
        self.cfg = cfg
        self.ignore_index = ignore_index
        self.start = vocab_start
        self.n_valid = max(0, min(width, vocab_size - vocab_start))
        self.dtype = dtype
        self.backend = "torch" if cfg.impl == "torch" else cfg.backend
        self.filter_eps = cfg.filter_eps if cfg.impl == "cce" else None

    def forward(self, h: Tensor, w: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """Merged per-token (lse, target logit) over every slice, identical on every rank (0 on ignored rows).

        Every rank builds the same targets, so every rank drops the same ignored rows before its kernels and
        the collectives carry valid rows only."""
        rows = valid_rows(targets, self.ignore_index)
        hv, tv = (h, targets) if rows is None else (h.index_select(0, rows), targets.index_select(0, rows))
        tv = local_targets(tv, self.start, self.n_valid)
        lse_l, tgt_l = shard_forward(hv, w, tv, self.n_valid, self.cfg.softcap, self.backend)
        FLOPS["forward"] += 2 * hv.shape[0] * self.n_valid * h.shape[1]
        group = state.mp_group()
        parts = torch.stack([lse_l.float(), tgt_l.float()])
        n = comm.world_size(group)
        if n > 1:
            parts = comm.all_gather(parts, group, "mp", dim=0, region=REGION).view(n, 2, -1)
        else:
            parts = parts.unsqueeze(0)
        lse, tgt = torch.logsumexp(parts[:, 0], dim=0), parts[:, 1].sum(0)
        return rows_to_all(lse, rows, h.shape[0]), rows_to_all(tgt, rows, h.shape[0])

    def backward(self, h: Tensor, w: Tensor, targets: Tensor, lse: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
        """(dE summed over every slice [n, h], this slice's dC) for per-token loss gradient ``g``."""
        n = h.shape[0]
        rows = valid_rows(targets, self.ignore_index)
        if rows is not None:
            h, targets, lse, g = (t.index_select(0, rows) for t in (h, targets, lse, g))
        z = self.cfg.z_loss
        gs = g * (1 + 2 * z * lse) if z else g
        perm = vocab_order(h, w, self.n_valid) if self.cfg.sort_vocab and self.filter_eps is not None else None
        t = local_targets(targets, self.start, self.n_valid)
        d_e, d_c = shard_backward(h, w, t, lse, gs, g, self.n_valid, self.cfg.softcap, self.filter_eps, perm,
                                  self.cfg.grad_accum_fp32, self.backend)  # fmt: skip
        FLOPS["backward"] += 4 * h.shape[0] * self.n_valid * h.shape[1]
        comm.all_reduce(d_e, state.mp_group(), "mp", region=REGION)
        return rows_to_all(d_e, rows, n), d_c


def _broadcast_from_last(t: Tensor) -> None:
    comm.broadcast(t, state.pp_last_rank(), state.pp_group(), "pp", region=REGION)


def _kept_backward(sl: _Slice, h: Tensor, w: Tensor, targets: Tensor, lse: Tensor, idx: Tensor, g: Tensor):
    """Collider: every slice's backward on the kept rows only; the dE all-reduce carries [k, h]."""
    return sl.backward(h.index_select(0, idx), w, targets.index_select(0, idx), lse.index_select(0, idx), g)


class _LastStageLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, sl: _Slice, sp: bool, ignore_index: int, keep):
        h_shape = hidden.shape
        h = hidden.reshape(-1, h_shape[-1]).to(sl.dtype)
        if sp:
            h = comm.all_gather(h, state.tp_group(), "tp", dim=0, region=REGION)
        h = h.contiguous()
        _broadcast_from_last(h)
        targets = targets.reshape(-1)
        lse, tgt = sl.forward(h, weight, targets)
        loss = lse - tgt
        if sl.cfg.z_loss:
            loss = loss + sl.cfg.z_loss * lse * lse
        valid = targets != ignore_index
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        ctx.save_for_backward(h, weight, targets, lse, valid)
        ctx.sl, ctx.sp, ctx.h_shape, ctx.keep = sl, sp, h_shape, keep
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor):
        h, weight, targets, lse, valid = ctx.saved_tensors
        g = torch.where(valid, grad.float(), torch.zeros_like(lse)).contiguous()
        meta = getattr(ctx.keep, "meta", None)
        lay = state.layout()
        with comm.phase("backward"):
            if meta is not None:  # collider: kept rows only, their indices travel with the gradient
                idx = meta.idx.contiguous()
                _broadcast_from_last(idx)
                g = g.index_select(0, idx)
                _broadcast_from_last(g)
                d_rows, d_c = _kept_backward(ctx.sl, h, weight, targets, lse, idx, g)
                if ctx.sp:
                    local, counts = rows.sp_split(meta, lay.tp, lay.tp_rank)
                    start = sum(counts[: lay.tp_rank])
                    d_rows, meta = d_rows[start : start + counts[lay.tp_rank]], local
                return CompactGrad(d_rows, meta, ctx.h_shape), d_c, None, None, None, None, None
            _broadcast_from_last(g)
            d_e, d_c = ctx.sl.backward(h, weight, targets, lse, g)
        if ctx.sp:
            d_e = d_e.chunk(lay.tp)[lay.tp_rank]
        return d_e.reshape(ctx.h_shape), d_c, None, None, None, None, None


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
) -> Tensor:
    """Last stage: per-token loss [n] fp32 with the vocabulary spread over every (pp, tp) rank.

    ``hidden`` is [s(/tp), b, h] (sequence shard under SP); ``weight`` is this rank's slice in the
    compute dtype. Every other pipeline rank must run ``VocabPPPeer.step`` for the same micro-batch.
    ``keep``: a KeepHolder whose ``meta`` selection fills before backward (collider: compact backward).
    """
    sl = _Slice(cfg, vocab_start, vocab_size, weight.shape[0], weight.dtype, ignore_index)
    return _LastStageLoss.apply(hidden, weight, targets, sl, sequence_parallel, ignore_index, keep)


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
        self.sl = _Slice(cfg, vocab_start, vocab_size, weight.shape[0], compute_dtype, ignore_index)

    def step(self, targets: Tensor, train: bool) -> None:
        """Join the last stage's loss of one micro-batch (forward, and with ``train`` its backward)."""
        w = self.weight.detach().to(self.sl.dtype)
        h = torch.empty(self.rows, w.shape[1], dtype=self.sl.dtype, device=w.device)
        targets = targets.reshape(-1)
        with comm.phase("forward"):
            _broadcast_from_last(h)
            lse, _ = self.sl.forward(h, w, targets)
        if not train:
            return
        with comm.phase("backward"):
            if self.kept_rows is not None:
                idx = torch.empty(self.kept_rows, dtype=torch.long, device=w.device)
                _broadcast_from_last(idx)
                g = torch.empty(self.kept_rows, dtype=lse.dtype, device=w.device)
                _broadcast_from_last(g)
                _, d_c = _kept_backward(self.sl, h, w, targets, lse, idx, g)
            else:
                g = torch.empty_like(lse)
                _broadcast_from_last(g)
                _, d_c = self.sl.backward(h, w, targets, lse, g)
        # this runs while stage 0 holds its most in-flight activations (lock step): free the compute-dtype
        # weight copy first and add in place, so no [V_slice, h] fp32 temporary joins the peak
        del w, h
        if self.weight.grad is None:
            self.weight.grad = torch.zeros_like(self.weight)
        self.weight.grad.add_(d_c)


class PPEmbedding(nn.Module):
    """Input embedding sliced over every (pp, tp) rank; lookups and gradients batched once per step.

    Not an autograd op: ``lookup_all`` hands the first stage leaf tensors, the trainer runs the
    pipeline, and ``backward_all`` turns the leaves' gradients into this slice's weight gradient.
    """

    def __init__(
        self,
        vocab_padded: int,
        hidden: int,
        *,
        init_std: float,
        seed: int,
        device,
        vocab_size: int,
        sequence_parallel: bool,
        compute_dtype: torch.dtype,
        rows_per_stage: list[int] | None = None,
    ):
        super().__init__()
        lay = state.layout()
        # stage r holds rows_per_stage[r] consecutive rows (even by default), split evenly over its TP ranks
        rows_per_stage = rows_per_stage or [vocab_padded // lay.pp] * lay.pp
        stage = rows_per_stage[lay.pp_rank]
        per = stage // lay.tp
        self.start = sum(rows_per_stage[: lay.pp_rank]) + lay.tp_rank * per
        full = padded_vocab_init("embedding", vocab_size, vocab_padded, hidden, init_std, seed, device)
        self.weight = nn.Parameter(full[self.start : self.start + per].contiguous())
        self.weight.tp_spec = (0, [stage])
        self.weight.pp_vocab = True
        self.sp = sequence_parallel
        self.dtype = compute_dtype
        self._local: list[Tensor] | None = None  # (local index, in-slice mask) of the step's ids

    def _shard(self, t: Tensor) -> Tensor:
        """[M, s, b, h] -> this TP rank's sequence shard under SP (the first stage's input layout)."""
        if not self.sp:
            return t
        lay = state.layout()
        return t.chunk(lay.tp, dim=1)[lay.tp_rank]

    @torch.no_grad()
    def lookup_all(self, ids: list[Tensor], requires_grad: bool) -> list[Tensor] | None:
        """[s, b] ids of every micro-batch -> the first stage's inputs [s(/tp), b, h] (None on other stages)."""
        out, *self._local = vocab_slice_lookup(torch.stack(ids), self.weight, self.start, self.dtype)
        with comm.phase("forward"):
            comm.all_reduce(out, state.mp_group(), "mp", region="embedding.vocab_pp")
        if not state.layout().is_first_stage:
            return None
        return [x.contiguous().requires_grad_(requires_grad) for x in self._shard(out).unbind(0)]

    @torch.no_grad()
    def backward_all(self, grads: list[Tensor | None] | None) -> None:
        """Add this slice's gradient from the first stage's input gradients of the whole step.

        ``grads``: per micro-batch, the gradient that reached the first stage's input (dense, compact, or None),
        on the first stage; None elsewhere."""
        lay = state.layout()
        assert self._local is not None, "backward_all without lookup_all"
        local, valid = self._local
        m, s, b = local.shape
        h = self.weight.shape[1]
        g = torch.zeros(m, s, b, h, dtype=self.dtype, device=self.weight.device)
        # each row of g has exactly one contributor, so the sum is exact in any dtype
        if grads is not None and (self.sp or lay.tp_rank == 0):
            mine = self._shard(g)
            for i, gi in enumerate(grads):
                if isinstance(gi, CompactGrad):  # kept rows only: scatter them, no dense gradient built
                    mine[i].view(-1, h).index_copy_(0, gi.meta.idx, gi.rows.to(self.dtype))
                elif gi is not None:
                    mine[i].copy_(gi)
        with comm.phase("backward"):
            comm.all_reduce(g, state.mp_group(), "mp", region="embedding.vocab_pp")
        dw = vocab_slice_grad(self.weight.shape, local, valid, g.reshape(-1, h)).to(self.weight.dtype)
        self.weight.grad = dw if self.weight.grad is None else self.weight.grad + dw
        self._local = None
