"""Row-wise ops with a filter-aware backward: RMSNorm and the SwiGLU gate.

Each backward accepts either a dense gradient or a ``CompactGrad``; with the latter it works on the
kept rows [k, ·] only. On the GPU the kernels read those rows of what forward saved through the
kept-row indices themselves; elsewhere the rows are gathered first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megasparse.ops.compact import CompactGrad, KeepMeta, rows_of
from megasparse.ops.glu import glu_backward_triton, glu_forward_triton
from megasparse.ops.rmsnorm_kernels import (
    rms_backward,
    rms_backward_reference,
    rms_forward,
    rms_forward_reference,
    triton,
)


def _rms_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton on the GPU (a compiled region cost ~0.2 ms of host time per call: ops/rmsnorm_kernels.py)."""
    if x.is_cuda and triton is not None:
        return rms_forward(x, weight, eps)
    return rms_forward_reference(x, weight, eps)


def _rms_bwd(
    x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, eps: float, meta: KeepMeta | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``meta``: g holds only its kept rows of x (the compact backward)."""
    if x.is_cuda and triton is not None:
        return rms_backward(x, w, g, eps, rows=None if meta is None else meta.idx)
    return rms_backward_reference(x if meta is None else rows_of(x, meta), w, g, eps)


class RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return _rms_fwd(x, weight, eps)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        if isinstance(g, CompactGrad):
            dx, dw = _rms_bwd(x, w, g.rows, ctx.eps, meta=g.meta)
            return CompactGrad(dx, g.meta, x.shape), dw.to(w.dtype), None
        dx, dw = _rms_bwd(x, w, g, ctx.eps)
        return dx, dw.to(w.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return RMSNormFn.apply(x, weight, eps)


def _swiglu_bwd(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    a, b = x.float().chunk(2, dim=-1)
    s = torch.sigmoid(a)
    silu = a * s
    gf = g.float()
    da = gf * b * (s * (1 + a * (1 - s)))
    db = gf * silu
    return torch.cat([da, db], dim=-1).to(x.dtype)


def _swiglu_bwd_any(x2d: torch.Tensor, g2d: torch.Tensor, meta: KeepMeta | None = None) -> torch.Tensor:
    """``meta``: g2d holds only its kept rows of x2d (the compact backward)."""
    if x2d.is_cuda:  # the fused Triton kernel (ops/glu.py), shared with the sparse FFN
        return glu_backward_triton(x2d, g2d.contiguous(), "swiglu", rows=None if meta is None else meta.idx)
    return _swiglu_bwd(x2d if meta is None else rows_of(x2d, meta), g2d)


class SwiGLUFn(torch.autograd.Function):
    """act(x[..., :f]) * x[..., f:] in megatron-core's chunk order (gate first, then up)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor):
        ctx.save_for_backward(x)
        if x.is_cuda:
            return glu_forward_triton(x.reshape(-1, x.shape[-1]), "swiglu").view(*x.shape[:-1], x.shape[-1] // 2)
        a, b = x.chunk(2, dim=-1)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        x2d = x.reshape(-1, x.shape[-1])
        if isinstance(g, CompactGrad):
            return CompactGrad(_swiglu_bwd_any(x2d, g.rows, meta=g.meta), g.meta, x.shape)
        return _swiglu_bwd_any(x2d, g.reshape(-1, g.shape[-1])).view(x.shape)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    return SwiGLUFn.apply(x)
