"""Row-wise ops with a filter-aware backward: RMSNorm and the SwiGLU gate.

Each backward accepts either a dense gradient or a ``CompactGrad``; with the latter it gathers
the kept rows of what forward saved and works on [k, ·] only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megasparse.ops.compact import CompactGrad, rows_of


def _rms_bwd(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, eps: float):
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xf * rstd
    gf = g.float()
    dw = (gf * xhat).reshape(-1, x.shape[-1]).sum(0)
    gw = gf * w.float()
    dx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype), dw


class RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        if isinstance(g, CompactGrad):
            dx, dw = _rms_bwd(rows_of(x, g.meta), w, g.rows, ctx.eps)
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


class SwiGLUFn(torch.autograd.Function):
    """act(x[..., :f]) * x[..., f:] in megatron-core's chunk order (gate first, then up)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor):
        ctx.save_for_backward(x)
        a, b = x.chunk(2, dim=-1)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if isinstance(g, CompactGrad):
            return CompactGrad(_swiglu_bwd(rows_of(x, g.meta), g.rows), g.meta, x.shape)
        return _swiglu_bwd(x, g)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    return SwiGLUFn.apply(x)
