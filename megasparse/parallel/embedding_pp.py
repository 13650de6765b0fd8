"""Input embedding sliced over every (pp, tp) rank (``loss.embedding_over_pp`` with ``loss.vocab_over_pp``).

Sliced like the output layer's pipeline slices (``loss/pipeline.py``), but batched per step instead of
per micro-batch, because a lookup depends on nothing but the token ids, which every rank has. At the start of a
step every rank looks up its slice for all micro-batches and ONE all-reduce over the model-parallel group
assembles the first stage's inputs; after the pipeline drains the first stage's input gradients of all
micro-batches go back the same way (one all-reduce) and every rank scatter-adds its slice's rows. Both sit outside
the pipeline schedule, which therefore needs no extra rendezvous; the price is a [micro-batches, s, b, h] buffer
and two collectives per step on the critical path (docs/decisions/0801-embedding-over-pp.md). An embedding layer,
not a loss: it imports nothing from the loss package.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from megasparse.ops.compact import CompactGrad
from megasparse.ops.wgrad import grad_buffer
from megasparse.parallel import comm, state
from megasparse.parallel.layers import padded_vocab_init, vocab_slice_grad, vocab_slice_lookup


def stage_rows(vocab_padded: int, shares: list[float], unit: int) -> list[int]:
    """Rows per pipeline stage for ``shares`` of a vocabulary matrix, whole ``unit``s, summing to vocab_padded."""
    units = vocab_padded // unit
    acc, bounds = 0.0, [0]
    for s in shares:
        acc += s
        bounds.append(min(units, int(round(acc * units))))
    bounds[-1] = units
    return [(b - a) * unit for a, b in zip(bounds, bounds[1:])]


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
        self.weight.vocab_rows = (self.start, vocab_size)  # global rows (checkpoints; parallel/shards.py)
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
        bucket = grad_buffer(self.weight)
        if bucket is not None:  # into the fp32 bucket slice (ops/wgrad.py): no temporary, no bf16 rounding
            vocab_slice_grad(self.weight.shape, local, valid, g.reshape(-1, h), bucket)
            self._local = None
            return
        dw = vocab_slice_grad(self.weight.shape, local, valid, g.reshape(-1, h)).to(self.weight.dtype)
        if self.weight.grad is None:
            self.weight.grad = dw
        else:  # in place: under data parallelism ``.grad`` is a slice of the bucket buffer (parallel/ddp.py)
            self.weight.grad.add_(dw)
        self._local = None
