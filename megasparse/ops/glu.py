"""Fused gated activations (SwiGLU, GEGLU) on the fc1 output, in megatron-core's chunk order.

Input z [n, 2f]: the first half is the gate (activated), the second the "up" half:
out = act(z[:, :f]) * z[:, f:]. Backward recomputes act from the saved input instead of saving
act(z), trading a few flops for [n, f] of activation memory. The kernels take strides, and the
output keeps the input's orientation (a column-major z, as a sparse GEMM may return, gives a
column-major out) so neither pass reads across the memory layout (the paper's L2-miss point).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

ACTIVATIONS = ("swiglu", "geglu")


def gated_activation_reference(z: torch.Tensor, kind: str = "swiglu") -> torch.Tensor:
    """Pure-torch act(z[:, :f]) * z[:, f:] (erf GELU for geglu)."""
    g, up = z.chunk(2, dim=-1)
    a = F.silu(g) if kind == "swiglu" else F.gelu(g)
    return a * up


if triton is not None:

    @triton.jit
    def _act(g, GELU: tl.constexpr):
        if GELU:
            cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
            a = g * cdf
            da = cdf + g * 0.3989422804014327 * tl.exp(-0.5 * g * g)
        else:
            sig = 1.0 / (1.0 + tl.exp(-g))
            a = g * sig
            da = sig * (1.0 + g * (1.0 - sig))
        return a, da

    @triton.jit
    def _load_gate_up(
        z_ptr, idx_ptr, n, f, sz0, sz1, GATHER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr
    ):
        # int64 offsets throughout: a column-major z read through row indices spans rows x 2f elements
        r = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        c = (tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)).to(tl.int64)
        ok = (r[:, None] < n) & (c[None, :] < f)
        if GATHER:  # row r of the result reads z's row idx[r]
            src = tl.load(idx_ptr + r, mask=r < n, other=0).to(tl.int64)
        else:
            src = r
        g = tl.load(z_ptr + src[:, None] * sz0 + c[None, :] * sz1, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(z_ptr + src[:, None] * sz0 + (c[None, :] + f) * sz1, mask=ok, other=0.0).to(tl.float32)
        return r, c, ok, g, up

    @triton.jit
    def _glu_fwd_kernel(
        z_ptr, o_ptr, n, f, sz0, sz1, so0, so1, GELU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr
    ):
        r, c, ok, g, up = _load_gate_up(z_ptr, z_ptr, n, f, sz0, sz1, False, BLOCK_N, BLOCK_F)
        a, _ = _act(g, GELU)
        tl.store(o_ptr + r[:, None] * so0 + c[None, :] * so1, (a * up).to(o_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _glu_bwd_kernel(
        z_ptr, go_ptr, dz_ptr, idx_ptr, n, f, sz0, sz1, sg0, sg1, sd0, sd1,
        GELU: tl.constexpr, GATHER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr,
    ):  # fmt: skip
        r, c, ok, g, up = _load_gate_up(z_ptr, idx_ptr, n, f, sz0, sz1, GATHER, BLOCK_N, BLOCK_F)
        go = tl.load(go_ptr + r[:, None] * sg0 + c[None, :] * sg1, mask=ok, other=0.0).to(tl.float32)
        a, da = _act(g, GELU)
        ty = dz_ptr.dtype.element_ty
        tl.store(dz_ptr + r[:, None] * sd0 + c[None, :] * sd1, (go * up * da).to(ty), mask=ok)
        tl.store(dz_ptr + r[:, None] * sd0 + (c[None, :] + f) * sd1, (go * a).to(ty), mask=ok)


def _like_layout(shape: tuple[int, int], ref: torch.Tensor) -> torch.Tensor:
    """Empty [shape] tensor in ``ref``'s orientation (column-major when ref is)."""
    if ref.stride(0) == 1 and ref.stride(1) != 1:
        return torch.empty(shape[1], shape[0], dtype=ref.dtype, device=ref.device).t()
    return torch.empty(shape, dtype=ref.dtype, device=ref.device)


def _blocks(z: torch.Tensor) -> tuple[int, int]:
    # Long side of the tile along the contiguous dimension.
    return (64, 16) if z.stride(0) == 1 else (16, 64)


def glu_forward_triton(z: torch.Tensor, kind: str = "swiglu") -> torch.Tensor:
    n, f2 = z.shape
    f = f2 // 2
    out = _like_layout((n, f), z)
    bn, bf = _blocks(z)
    grid = (math.ceil(n / bn), math.ceil(f / bf))
    _glu_fwd_kernel[grid](
        z, out, n, f, z.stride(0), z.stride(1), out.stride(0), out.stride(1),
        GELU=kind == "geglu", BLOCK_N=bn, BLOCK_F=bf,
    )  # fmt: skip
    return out


def glu_backward_triton(
    z: torch.Tensor, grad_out: torch.Tensor, kind: str = "swiglu", rows: torch.Tensor | None = None
) -> torch.Tensor:
    """dz for dout = ``grad_out``. With ``rows`` (kept-row indices into z), ``grad_out`` and dz hold only those
    rows and the kernel reads them from the full z: the compact backward gathers no copy of z first."""
    f2 = z.shape[1]
    f = f2 // 2
    if rows is None:
        n = z.shape[0]
        dz = _like_layout((n, f2), z)
        bn, bf = _blocks(z)
    else:
        n = rows.numel()
        if grad_out.shape[0] != n:
            raise ValueError(f"glu_backward_triton: {n} row indices for a gradient of {grad_out.shape[0]} rows")
        rows = rows.contiguous()
        dz = _like_layout((n, f2), grad_out)
        bn, bf = _blocks(grad_out)
    grid = (math.ceil(n / bn), math.ceil(f / bf))
    _glu_bwd_kernel[grid](
        z, grad_out, dz, z if rows is None else rows, n, f, z.stride(0), z.stride(1),
        grad_out.stride(0), grad_out.stride(1), dz.stride(0), dz.stride(1),
        GELU=kind == "geglu", GATHER=rows is not None, BLOCK_N=bn, BLOCK_F=bf,
    )  # fmt: skip
    return dz


class GatedActivationFn(torch.autograd.Function):
    """Triton forward/backward; backward recomputes act(gate) from the saved fc1 output."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, kind: str) -> torch.Tensor:
        ctx.save_for_backward(z)
        ctx.kind = kind
        return glu_forward_triton(z, kind)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (z,) = ctx.saved_tensors
        return glu_backward_triton(z, grad_out, ctx.kind), None


def gated_activation(z: torch.Tensor, kind: str = "swiglu") -> torch.Tensor:
    """act(z[:, :f]) * z[:, f:] for 2-D z [n, 2f]: fused Triton kernel on GPU, torch elsewhere."""
    if kind not in ACTIVATIONS:
        raise ValueError(f"gated_activation: kind={kind!r}, use one of {ACTIVATIONS}")
    if z.dim() != 2 or z.shape[1] % 2:
        raise ValueError(f"gated_activation: need z [n, 2f], got {list(z.shape)}")
    if z.is_cuda and triton is not None:
        return GatedActivationFn.apply(z, kind)
    return gated_activation_reference(z, kind)
