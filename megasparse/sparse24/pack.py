"""Value packing for cuSPARSELt operands: the kept values of W ⊙ M, two per group of four along a row, in column
order, written over the value part of an operand compressed once per mask (decision 0300). The Triton kernel,
its launcher and the pure-torch reference the tests compare it against."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None


def pack_values_reference(w: torch.Tensor, mask: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """Kept values of 2:4 masked ``w`` [r, c] as [r, c/2] row-major; with ``transpose`` those of wᵀ, [c, r/2]."""
    if transpose:
        w, mask = w.t(), mask.t()
    return w[mask].reshape(w.shape[0], w.shape[1] // 2)


if triton is not None:

    @triton.jit
    def _pack_kernel(w_ptr, m_ptr, o_ptr, R, C, sw, sm, so, TRANS: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr):
        # Load a [rows, cols] tile of W and of its mask coalesced, keep the first and second kept value of every
        # group of 4 (along cols, or along rows when TRANS), and store them as contiguous pairs.
        if TRANS:  # tile [4*BA rows, BB cols]; output rows are W's columns
            r = tl.program_id(0) * (4 * BA) + tl.arange(0, 4 * BA)
            c = tl.program_id(1) * BB + tl.arange(0, BB)
        else:  # tile [BA rows, 4*BB cols]
            r = tl.program_id(0) * BA + tl.arange(0, BA)
            c = tl.program_id(1) * (4 * BB) + tl.arange(0, 4 * BB)
        ok = (r[:, None] < R) & (c[None, :] < C)
        w = tl.load(w_ptr + r[:, None] * sw + c[None, :], mask=ok, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + r[:, None] * sm + c[None, :], mask=ok, other=0).to(tl.int32)
        if TRANS:
            w3 = tl.reshape(w, (BA, 4, BB))
            m3 = tl.reshape(m, (BA, 4, BB))
            ax: tl.constexpr = 1
        else:
            w3 = tl.reshape(w, (BA, BB, 4))
            m3 = tl.reshape(m, (BA, BB, 4))
            ax: tl.constexpr = 2
        rank = tl.cumsum(m3, axis=ax) * m3  # 1 at the first kept entry, 2 at the second, 0 elsewhere
        first = tl.sum(tl.where(rank == 1, w3, 0.0), axis=ax)
        second = tl.sum(tl.where(rank == 2, w3, 0.0), axis=ax)
        pair = tl.join(first, second)  # [BA, BB, 2]
        ty = o_ptr.dtype.element_ty
        if TRANS:
            out = tl.reshape(tl.permute(pair, (1, 0, 2)), (BB, 2 * BA)).to(ty)
            orow = c
            ocol = tl.program_id(0) * (2 * BA) + tl.arange(0, 2 * BA)
            okr = (orow[:, None] < C) & (ocol[None, :] < R // 2)
        else:
            out = tl.reshape(pair, (BA, 2 * BB)).to(ty)
            orow = r
            ocol = tl.program_id(1) * (2 * BB) + tl.arange(0, 2 * BB)
            okr = (orow[:, None] < R) & (ocol[None, :] < C // 2)
        tl.store(o_ptr + orow[:, None] * so + ocol[None, :], out, mask=okr)


def pack_values(
    w: torch.Tensor, mask: torch.Tensor, out: torch.Tensor | None = None, transpose: bool = False
) -> torch.Tensor:
    """Kept values of ``w`` ⊙ ``mask`` (row-major [r, c]) into ``out``: [r, c/2], or [c, r/2] for wᵀ."""
    r, c = w.shape
    shape = (c, r // 2) if transpose else (r, c // 2)
    if out is None:
        out = torch.empty(shape, dtype=w.dtype, device=w.device)
    if not (w.is_cuda and triton is not None):
        out.copy_(pack_values_reference(w, mask, transpose))
        return out
    if w.stride(1) != 1:
        w = w.contiguous()
    m8 = mask.contiguous().view(torch.uint8)
    ba, bb = (32, 64) if transpose else (16, 64)
    grid = (triton.cdiv(r, 4 * ba if transpose else ba), triton.cdiv(c, bb if transpose else 4 * bb))
    _pack_kernel[grid](
        w, m8, out, r, c, w.stride(0), m8.stride(0), out.stride(0), TRANS=transpose, BA=ba, BB=bb
    )  # fmt: skip
    return out


def _values_view(packed: torch.Tensor, r: int, c: int) -> torch.Tensor:
    """The value part of a cuSPARSELt-compressed [r, c] operand (torch returns it flat or 2-D, values first)."""
    return packed.view(-1)[: r * c // 2].view(r, c // 2)
