"""Tensor- and sequence-parallel building blocks: column/row-parallel linear, vocab-parallel embedding.

Each layer's autograd Function owns its TP/SP communication so that the backward can (a) overlap
the input-gradient collective with the weight-gradient GEMM, as Megatron does, and (b) run on
compact gradients (token filtering): then the GEMMs and the collectives carry only kept rows.
Parameters are fp32 masters; compute runs in ``compute_dtype`` (bf16 on GPU), and weight
gradients are returned in fp32.

Layouts: activations are [s, b, h] (s-major). With sequence parallelism a TP-region input is
all-gathered along s and a TP-region output reduce-scattered along s.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from megasparse.ops.compact import CompactGrad, KeepMeta, rows_of
from megasparse.ops.wgrad import accumulate_mm, grad_buffer
from megasparse.parallel import comm, rows
from megasparse.parallel.groups import ProcessGroups


class DenseGemm:
    """The three GEMMs of a linear layer; the 2:4 sparse FFN swaps in its own."""

    def fwd(self, x2d: torch.Tensor, w: torch.Tensor, for_wgrad: bool = False) -> torch.Tensor:
        """``for_wgrad``: a weight gradient of this input follows (fp8 then keeps its cast of it: decision 1245)."""
        return x2d @ w.t()

    def dgrad(self, g2d: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return g2d @ w

    def take_saved_input(self) -> None:
        """What the layer saves for the weight gradient instead of its input: nothing here, the input itself (fp8
        keeps its e4m3 transpose, ``fp8/gemm.py``); a gemm that returns something also has ``wgrad_input``."""
        return None

    def take_x_amax(self) -> None:
        """What the last ``fwd`` keeps for the weight gradient's cast of the same input: nothing here (fp8 keeps
        its input's amax, ``fp8/gemm.py``)."""
        return None

    def wgrad(self, g2d: torch.Tensor, x2d: torch.Tensor, x_amax: torch.Tensor | None = None) -> torch.Tensor:
        return g2d.t() @ x2d

    def wgrad_into(
        self, g2d: torch.Tensor, x2d: torch.Tensor, out: torch.Tensor, x_amax: torch.Tensor | None = None
    ) -> bool:
        """out += g2dᵀ·x2d in ``out``'s dtype (fp32); False: this gemm cannot, use ``wgrad``. ``x_amax``: what
        ``take_x_amax`` gave after the forward whose whole input ``x2d`` is (None for a compact backward's rows)."""
        accumulate_mm(out, g2d.t(), x2d)
        return True


DENSE = DenseGemm()


def weight_grad(
    weight: torch.Tensor, gemm, g2d: torch.Tensor, x2d: torch.Tensor, x_amax: torch.Tensor | None = None
) -> torch.Tensor | None:
    """A linear layer's weight gradient, added straight into its fp32 bucket slice when it has one (``ops/wgrad.py``,
    decision 0009; None goes back to autograd). Otherwise (no buckets, ``.grad`` detached from the bucket, a gemm
    that cannot) the gradient is returned for autograd to accumulate."""
    main = grad_buffer(weight)
    if main is not None and gemm.wgrad_into(g2d, x2d, main, x_amax):
        return None
    return gemm.wgrad(g2d, x2d, x_amax).to(weight.dtype)


class ComputeCopy:
    """One fp32 master weight's compute-dtype copy. Read through ``get``: a weight changed in place since the last
    copy (its version moved) is copied again on the spot, so a forward never reads a stale operand."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        self.weight = weight
        self.buf = weight.detach().to(dtype)
        self.version = weight._version

    def get(self) -> torch.Tensor:
        if self.weight._version != self.version:
            self.buf.copy_(self.weight.detach())  # in place: a captured micro-batch keeps reading this buffer
            self.version = self.weight._version
        return self.buf


class ComputeCopies:
    """bf16 copies of the linear layers' fp32 master weights (and of the output weight, for a module with an
    ``output_copy`` slot), made once per optimizer step instead of once per micro-batch and layer (decision 0009):
    ``refresh`` after every optimizer step and checkpoint load.

    A fused optimizer writes the masters without moving their version counters, so ``refresh`` is the contract;
    ``ComputeCopy.get``'s version check covers every other in-place write (a load, a test)."""

    def __init__(self, model: nn.Module) -> None:
        self.copies: list[ComputeCopy] = []
        for m in model.modules():
            if (
                isinstance(m, _ParallelLinear)
                and getattr(m.gemm, "operand", None) is None  # a 2:4 GEMM keeps its own operands
                and m.weight.dtype != m.compute_dtype
            ):
                m.copy = ComputeCopy(m.weight, m.compute_dtype)
                self.copies.append(m.copy)
            elif hasattr(m, "output_copy") and m.output_weight.dtype != m.compute_dtype:  # the output layer's slot
                m.output_copy = ComputeCopy(m.output_weight, m.compute_dtype)
                self.copies.append(m.output_copy)

    def refresh(self) -> None:
        if self.copies:
            torch._foreach_copy_([c.buf for c in self.copies], [c.weight.detach() for c in self.copies])
            for c in self.copies:
                c.version = c.weight._version

    @property
    def numel(self) -> int:
        return sum(c.buf.numel() for c in self.copies)


def seeded_full_init(name: str, shape: tuple[int, ...], std: float, seed: int, device) -> torch.Tensor:
    """The full (unsharded) initial value of parameter ``name``: identical for every layout."""
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std


def padded_vocab_init(name: str, vocab: int, vocab_padded: int, hidden: int, std: float, seed: int, device):
    """Vocabulary matrix whose real rows do not depend on the padding (so every TP size starts equal)."""
    full = torch.zeros(vocab_padded, hidden, device=device)
    full[:vocab] = seeded_full_init(name, (vocab, hidden), std, seed, device)
    return full


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _save_input(ctx, gemm, x: torch.Tensor, w: torch.Tensor) -> None:
    """Save (x, w), or (what the gemm keeps of x instead, w): fp8's e4m3 xᵀ and scale (decision 1245)."""
    kept = gemm.take_saved_input()
    ctx.n_kept = 0 if kept is None else len(kept)
    if kept is None:
        ctx.save_for_backward(x, w)
    else:
        ctx.save_for_backward(*kept, w)


def _saved_input(ctx) -> tuple[torch.Tensor | tuple[torch.Tensor, ...], torch.Tensor]:
    """(x or the gemm's tuple kept in its place, w) from ``_save_input``."""
    *xs, w = ctx.saved_tensors
    return (xs[0] if ctx.n_kept == 0 else tuple(xs)), w


def _wgrad_rows(ctx, gemm, x, meta: KeepMeta | None = None):
    """The weight gradient's input: x's rows (all, or a compact backward's kept ones), or the gemm's own kept form."""
    if ctx.n_kept:
        return gemm.wgrad_input(x, None if meta is None else meta.idx)
    return _flat(x) if meta is None else rows_of(x, meta)


class ColumnParallelLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, wc, sp: bool, dtype, gemm, name: str, pg: ProcessGroups, grad: bool):
        group = pg.tp_group
        total = comm.all_gather(x, group, "tp", dim=0, region=f"{name}.sp_gather") if sp else x
        w = weight.to(dtype) if wc is None else wc
        y = gemm.fwd(_flat(total), w, grad and ctx.needs_input_grad[1]).view(*total.shape[:-1], w.shape[0])
        _save_input(ctx, gemm, total, w)
        ctx.cfg = (sp, gemm, name, x.shape, weight, pg)
        ctx.x_amax = gemm.take_x_amax()  # the whole-input weight gradient's cast reuses it
        return y

    @staticmethod
    def backward(ctx, g):
        total, w = _saved_input(ctx)
        sp, gemm, name, x_shape, weight, pg = ctx.cfg
        group = pg.tp_group
        region = f"{name}.dgrad"
        if isinstance(g, CompactGrad):
            meta = g.meta
            dx = gemm.dgrad(g.rows, w)
            if sp:
                dx, meta_out, work = rows.reduce_scatter_rows(dx, meta, group, pg.tp, pg.tp_rank, region)
            else:
                meta_out, work = meta, comm.all_reduce(dx, group, "tp", region=region, async_op=True)
            dw = weight_grad(weight, gemm, g.rows, _wgrad_rows(ctx, gemm, total, meta))  # overlaps the collective
            if work is not None:
                work.wait()
            return CompactGrad(dx, meta_out, x_shape), dw, None, None, None, None, None, None, None
        g2 = _flat(g)
        dx = gemm.dgrad(g2, w).view(*g.shape[:-1], w.shape[1])
        if sp:
            dx, work = comm.reduce_scatter(dx, group, "tp", region=region, async_op=True)
        else:
            work = comm.all_reduce(dx, group, "tp", region=region, async_op=True)
        dw = weight_grad(weight, gemm, g2, _wgrad_rows(ctx, gemm, total), ctx.x_amax)
        if work is not None:
            work.wait()
        return dx, dw, None, None, None, None, None, None, None


class RowParallelLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, wc, sp: bool, dtype, gemm, name: str, pg: ProcessGroups, grad: bool):
        group = pg.tp_group
        w = weight.to(dtype) if wc is None else wc
        y = gemm.fwd(_flat(x), w, grad and ctx.needs_input_grad[1]).view(*x.shape[:-1], w.shape[0])
        if sp:
            y = comm.reduce_scatter(y, group, "tp", region=f"{name}.sp_scatter")
        else:
            comm.all_reduce(y, group, "tp", region=f"{name}.out")
        _save_input(ctx, gemm, x, w)
        ctx.cfg = (sp, gemm, name, weight, pg, x.shape)
        ctx.x_amax = gemm.take_x_amax()
        return y

    @staticmethod
    def backward(ctx, g):
        x, w = _saved_input(ctx)
        sp, gemm, name, weight, pg, x_shape = ctx.cfg
        group = pg.tp_group
        if isinstance(g, CompactGrad):
            gr, meta = g.rows, g.meta
            if sp:
                gr, meta = rows.gather_rows(gr, meta, group, pg.tp, pg.tp_rank, f"{name}.sp_gather")
            dx = gemm.dgrad(gr, w)
            dw = weight_grad(weight, gemm, gr, _wgrad_rows(ctx, gemm, x, meta))
            return CompactGrad(dx, meta, x_shape), dw, None, None, None, None, None, None, None
        if sp:
            g = comm.all_gather(g, group, "tp", dim=0, region=f"{name}.sp_gather")
        g2 = _flat(g)
        dx = gemm.dgrad(g2, w).view(*g.shape[:-1], w.shape[1])
        dw = weight_grad(weight, gemm, g2, _wgrad_rows(ctx, gemm, x), ctx.x_amax)
        return dx, dw, None, None, None, None, None, None, None


def vocab_slice_lookup(ids: torch.Tensor, weight: torch.Tensor, start: int, dtype) -> tuple[torch.Tensor, ...]:
    """Rows of ``ids`` from the vocabulary slice [start, start + rows) (zeros for ids elsewhere, so summing every
    slice's lookup gives the embedding); also (local index, in-slice mask) for ``vocab_slice_grad``."""
    local = ids - start
    valid = (local >= 0) & (local < weight.shape[0])
    local = torch.where(valid, local, torch.zeros_like(local))
    if weight.shape[0] == 0:  # a slice with no rows still contributes its zeros to the sum
        return ids.new_zeros(*ids.shape, weight.shape[1], dtype=dtype), local, valid
    return weight[local].to(dtype) * valid.unsqueeze(-1).to(dtype), local, valid  # gather, then cast the rows


def vocab_slice_grad(
    shape, local: torch.Tensor, valid: torch.Tensor, g2d: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 weight gradient of a vocabulary slice: rows of ``g2d`` scatter-added at ``local`` where ``valid``
    (masked, not boolean-indexed: no host sync). ``out`` (the weight's fp32 bucket slice, ``ops/wgrad.py``): added
    there instead of into a fresh weight-sized buffer, which is then returned."""
    dw = torch.zeros(shape, dtype=torch.float32, device=g2d.device) if out is None else out
    if shape[0]:
        dw.index_add_(0, local.reshape(-1), g2d.float() * valid.reshape(-1, 1))
    return dw


class VocabEmbeddingFn(torch.autograd.Function):
    """Lookup of this rank's vocabulary slice, then the TP reduction (reduce-scatter under SP)."""

    @staticmethod
    def forward(ctx, ids, weight, vocab_start: int, sp: bool, dtype, pg: ProcessGroups):
        group = pg.tp_group
        out, local, valid = vocab_slice_lookup(ids, weight, vocab_start, dtype)
        if sp:
            out = comm.reduce_scatter(out, group, "tp", region="embedding.sp_scatter")
        else:
            comm.all_reduce(out, group, "tp", region="embedding.out")
        ctx.save_for_backward(local, valid)
        ctx.cfg = (sp, weight.shape, weight.dtype, weight, pg)
        return out

    @staticmethod
    def backward(ctx, g):
        local, valid = ctx.saved_tensors
        sp, wshape, wdtype, weight, pg = ctx.cfg
        group = pg.tp_group
        bucket = grad_buffer(weight)  # rows added straight into the fp32 bucket slice: no weight-sized temporary
        if isinstance(g, CompactGrad):
            gr, meta = g.rows, g.meta
            if sp:
                gr, meta = rows.gather_rows(gr, meta, group, pg.tp, pg.tp_rank, "embedding.sp_gather")
            ids, ok = local.reshape(-1).index_select(0, meta.idx), valid.reshape(-1).index_select(0, meta.idx)
            dw = vocab_slice_grad(wshape, ids, ok, gr, bucket)
        else:
            if sp:
                g = comm.all_gather(g, group, "tp", dim=0, region="embedding.sp_gather")
            dw = vocab_slice_grad(wshape, local, valid, _flat(g), bucket)
        return None, None if bucket is not None else dw.to(wdtype), None, None, None, None


class _ParallelBase(nn.Module):
    def __init__(self, name: str, sequence_parallel: bool, compute_dtype: torch.dtype, pg: ProcessGroups):
        super().__init__()
        self.pg = pg
        """The TP group this layer's Functions talk over (given at construction, never read from global state)."""
        self.pname = name
        self.sequence_parallel = sequence_parallel
        self.compute_dtype = compute_dtype
        self.gemm = DENSE


class _ParallelLinear(_ParallelBase):
    fn: type[torch.autograd.Function]
    copy: ComputeCopy | None = None
    """The weight's compute-dtype copy, refreshed once per optimizer step (``ComputeCopies``); None: cast per call."""

    def compute_weight(self) -> torch.Tensor | None:
        """The GEMM operand in compute dtype when one is kept (the gemm's own, else ``copy``); None: cast per call."""
        own = getattr(self.gemm, "operand", None)
        if own is not None:
            return own()
        return None if self.copy is None else self.copy.get()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wc = self.compute_weight()
        sp, dtype = self.sequence_parallel, self.compute_dtype
        # whether autograd records this call (a weight gradient may follow): inside a Function's forward grad mode
        # is always off, and ctx.needs_input_grad is True under no_grad too (fp8 would cast an xᵀ for nothing: 1245)
        grad = torch.is_grad_enabled()
        return self.fn.apply(x, self.weight, wc, sp, dtype, self.gemm, self.pname, self.pg, grad)


class ColumnParallelLinear(_ParallelLinear):
    """Y = X·Wᵀ with W's rows split over TP ranks; ``partitions`` are sharded separately (e.g. q|k|v)."""

    fn = ColumnParallelLinearFn

    def __init__(
        self,
        in_features: int,
        partitions: list[int],
        *,
        name: str,
        init_std: float,
        seed: int,
        device,
        pg: ProcessGroups,
        sequence_parallel: bool = False,
        compute_dtype: torch.dtype = torch.float32,
    ):
        super().__init__(name, sequence_parallel, compute_dtype, pg)
        shards = []
        for i, size in enumerate(partitions):
            full = seeded_full_init(f"{name}.part{i}", (size, in_features), init_std, seed, device)
            shards.append(full.chunk(pg.tp, dim=0)[pg.tp_rank])
        self.weight = nn.Parameter(torch.cat(shards, dim=0))
        self.weight.tp_spec = (0, list(partitions))


class RowParallelLinear(_ParallelLinear):
    """Y = X·Wᵀ with W's columns split over TP ranks; the partial outputs are summed (or reduce-scattered)."""

    fn = RowParallelLinearFn

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        name: str,
        init_std: float,
        seed: int,
        device,
        pg: ProcessGroups,
        sequence_parallel: bool = False,
        compute_dtype: torch.dtype = torch.float32,
    ):
        super().__init__(name, sequence_parallel, compute_dtype, pg)
        full = seeded_full_init(name, (out_features, in_features), init_std, seed, device)
        self.weight = nn.Parameter(full.chunk(pg.tp, dim=1)[pg.tp_rank].contiguous())
        self.weight.tp_spec = (1, [in_features])


class VocabParallelEmbedding(_ParallelBase):
    """Input embedding with the (padded) vocabulary split over TP ranks."""

    def __init__(
        self,
        vocab_padded: int,
        hidden: int,
        *,
        name: str,
        init_std: float,
        seed: int,
        device,
        vocab_size: int,
        pg: ProcessGroups,
        sequence_parallel: bool = False,
        compute_dtype: torch.dtype = torch.float32,
    ):
        super().__init__(name, sequence_parallel, compute_dtype, pg)
        full = padded_vocab_init(name, vocab_size, vocab_padded, hidden, init_std, seed, device)
        self.per_rank = vocab_padded // pg.tp
        self.vocab_start = pg.tp_rank * self.per_rank
        self.weight = nn.Parameter(full[self.vocab_start : self.vocab_start + self.per_rank].contiguous())
        self.weight.tp_spec = (0, [vocab_padded])
        self.weight.vocab_rows = (self.vocab_start, vocab_size)  # global rows; padding past vocab_size

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        sp, dtype = self.sequence_parallel, self.compute_dtype
        return VocabEmbeddingFn.apply(ids, self.weight, self.vocab_start, sp, dtype, self.pg)
