"""The fp8 GEMMs behind a tensor-parallel linear layer (qkv, proj, fc1, fc2), plugged in like the 2:4 GEMM.

``ColumnParallelLinear`` / ``RowParallelLinear`` call ``gemm.fwd / dgrad / wgrad_into`` on rows (all of them, or a
compact backward's kept rows); ``Fp8Gemm`` quantises each operand as it enters its GEMM (dynamic scaling,
``cast.py``) and multiplies in fp8:

    forward  y  = x  · Wᵀ     x e4m3, W e4m3                 scales: x per row / W per output row
    dgrad    dx = g  · W      g e5m2, W e4m3 (its transpose)  scales: g per row / W per input column
    wgrad    dW = gᵀ · x      g e5m2, x e4m3, over tokens      scales: g per output feature / x per input feature

(the scales' axes are ``rowwise``'s; ``tensorwise`` has one per operand). ``torch._scaled_mm`` scales rows of its
first operand and columns of its second, never along the reduction, so each rowwise scale runs along the GEMM's
reduction dimension: the weight needs two fp8 copies with different scales (W per row for the forward, Wᵀ per row
for dgrad), and the weight gradient's operands are scaled per feature over the tokens. Both copies are made once per
optimizer step (``refresh``), like the bf16 ``ComputeCopies``; the layer saves the e4m3 W as its operand.

On CUDA (sm_89+): ``torch._scaled_mm`` (first operand row-major, second column-major, its inner and output dims
multiples of 16: the weight-gradient GEMM's token dimension is zero-padded to a multiple of 16, which the compact
backward's kept-row count need not be). Outputs are in the compute dtype; the weight gradient is fp32 (tensorwise)
or bf16 (rowwise: the only wide output the Hopper rowwise kernels are sure to give) and is added into the fp32
bucket slice. Elsewhere: the exact emulation (``emulated_mm``): the same fp8 values and scales, dequantised
(exactly) and multiplied in fp32, which the tests hold the CUDA path and the layers to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from megasparse.fp8.cast import E4M3, E5M2, Axis, amax_triton, dequantize, quantize, quantize_triton, use_triton
from megasparse.ops.wgrad import accumulate_mm

Recipe = Literal["tensorwise", "rowwise"]


def emulated_mm(
    a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, axes: tuple[Axis, Axis], out_dtype
) -> torch.Tensor:
    """(a·sa)·(b·sb)ᵀ in fp32 for fp8 ``a`` [M, K] and ``b`` [N, K] with their inverse scales; ``axes``: each
    operand's scale axis (``row``: per row of a / of b, i.e. per output row / column)."""
    return (dequantize(a, sa, axes[0]) @ dequantize(b, sb, axes[1]).t()).to(out_dtype)


def scaled_mm(
    a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, axes: tuple[Axis, Axis], out_dtype
) -> torch.Tensor:
    """``emulated_mm`` through ``torch._scaled_mm`` on CUDA: ``b`` [N, K] row-major is its column-major second
    operand as ``b.t()``; a row scale is [M, 1] for a and [1, N] for b."""
    if not a.is_cuda:
        return emulated_mm(a, sa, b, sb, axes, out_dtype)
    if axes[0] == "row":
        sa, sb = sa.reshape(-1, 1), sb.reshape(1, -1)
    return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)


def _pad16(n: int) -> int:
    return -(-n // 16) * 16


class Fp8Gemm:
    """fp8 GEMMs of one linear layer (``parallel/layers.py``'s pluggable gemm), with its fp8 weight copies."""

    def __init__(
        self, param: torch.nn.Parameter, recipe: Recipe, wgrad_fp8: bool = False, source: Callable | None = None
    ) -> None:
        self.param, self.recipe, self.wgrad_fp8 = param, recipe, wgrad_fp8
        self.source = source
        """What the fp8 copies are made from: None, the master; a 2:4 layer's ``weight_and_mask`` (W, M or None),
        whose W ⊙ M the casts read without a product being made (decision 1235)."""
        self.axis: Axis = "row" if recipe == "rowwise" else "tensor"
        self.w8: torch.Tensor | None = None  # W [N, K] e4m3, forward
        self.w8t: torch.Tensor | None = None  # Wᵀ [K, N] e4m3, dgrad
        self.sw = self.swt = None  # their inverse scales (per row of each under rowwise)
        self.version: int | None = None
        self._g_t: tuple | None = None  # (g, gᵀ e5m2, scale): dgrad's cast handed to the wgrad that follows it
        self._x_amax: torch.Tensor | None = None  # the last fwd's input amax, until the layer takes it

    # -- the weight's fp8 copies, once per optimizer step ------------------------------------------
    def refresh(self) -> None:
        """Quantise the current weight into the fp8 copies, in place (a captured step keeps reading the same
        buffers). The converter calls this after every optimizer step and checkpoint load."""
        w, m = (self.param.detach(), None) if self.source is None else self.source()
        if self.recipe == "tensorwise" and use_triton(w):  # one scale: W and Wᵀ from one read
            q, qt, s = quantize_triton(w, E4M3, "tensor", transpose=True, mask=m)
            st = s
        elif self.recipe == "tensorwise":
            q, s = quantize(w, E4M3, "tensor", mask=m)
            qt, st = q.t().contiguous(), s
        else:
            q, s = quantize(w, E4M3, "row", mask=m)
            qt, st = quantize(w, E4M3, "col", transpose=True, mask=m)
        if self.w8 is None:
            self.w8, self.w8t, self.sw, self.swt = q, qt, s, st
        else:
            for buf, new in ((self.w8, q), (self.w8t, qt), (self.sw, s), (self.swt, st)):
                buf.copy_(new)
        self.version = self.param._version

    def operand(self) -> torch.Tensor:
        """The layer's saved weight operand: the e4m3 W, refreshed on the spot if the master moved in place since
        the last copy (a fused optimizer does not move the version: the converter's ``refresh`` is the contract)."""
        if self.w8 is None or self.param._version != self.version:
            self.refresh()
        return self.w8

    # -- the three GEMMs ---------------------------------------------------------------------------
    def fwd(self, x2d: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        self._x_amax = None
        if self.recipe == "tensorwise" and self.wgrad_fp8 and use_triton(x2d):
            # the weight gradient casts this same x again (transposed, same single scale): its amax is kept for
            # that cast, which then skips its read of x (``take_x_amax``; the layer holds it until its backward)
            self._x_amax = amax_triton(x2d, "tensor")
            q, _, s = quantize_triton(x2d, E4M3, "tensor", amax=self._x_amax)
        else:
            q, s = quantize(x2d, E4M3, self.axis)
        return scaled_mm(q, s, self.w8, self.sw, (self.axis, self.axis), x2d.dtype)

    def take_x_amax(self) -> torch.Tensor | None:
        """The amax of the input of the ``fwd`` just run (tensorwise, fp8 weight gradient, Triton casts; else None),
        handed over once: the layer keeps it for ``wgrad_into(..., x_amax=)`` on that same input."""
        a, self._x_amax = self._x_amax, None
        return a

    def dgrad(self, g2d: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.recipe == "tensorwise" and self.wgrad_fp8 and use_triton(g2d):
            # one scale serves both GEMMs: one read of g writes it and its padded transpose for the wgrad that the
            # layer runs next on the same g (parallel/layers.py)
            q, qt, s = quantize_triton(g2d, E5M2, "tensor", transpose=True, pad_to=_pad16(g2d.shape[0]))
            self._g_t = (g2d, qt, s)
        else:
            q, s = quantize(g2d, E5M2, self.axis)
        return scaled_mm(q, s, self.w8t, self.swt, (self.axis, self.axis), g2d.dtype)

    def _wgrad(
        self, g2d: torch.Tensor, x2d: torch.Tensor, out_dtype: torch.dtype, x_amax: torch.Tensor | None = None
    ) -> torch.Tensor:
        """dW = gᵀ·x in fp8 over the tokens: both operands quantised per feature (rowwise) into their transposes,
        the token dimension zero-padded to a multiple of 16 on CUDA. ``x_amax``: ``take_x_amax`` of the forward
        whose input ``x2d`` is, whole (never a compact backward's kept rows: their amax may be smaller)."""
        ax: Axis = "col" if self.recipe == "rowwise" else "tensor"
        pad = _pad16(g2d.shape[0]) if g2d.is_cuda or use_triton(g2d) else None
        stash, self._g_t = self._g_t, None
        if stash is not None and stash[0] is g2d:
            gt, sg = stash[1], stash[2]
        else:
            gt, sg = quantize(g2d, E5M2, ax, transpose=True, pad_to=pad)
        if x_amax is not None and ax == "tensor" and use_triton(x2d):
            _, xt, sx = quantize_triton(x2d, E4M3, "tensor", write_q=False, transpose=True, pad_to=pad, amax=x_amax)
        else:
            xt, sx = quantize(x2d, E4M3, ax, transpose=True, pad_to=pad)
        back: Axis = "row" if ax == "col" else "tensor"  # a column of g is a row of gᵀ
        return scaled_mm(gt, sg, xt, sx, (back, back), out_dtype)

    def wgrad(self, g2d: torch.Tensor, x2d: torch.Tensor, x_amax: torch.Tensor | None = None) -> torch.Tensor:
        if not self.wgrad_fp8:
            return g2d.t() @ x2d
        return self._wgrad(g2d, x2d, self._wide(g2d), x_amax)

    def wgrad_into(
        self, g2d: torch.Tensor, x2d: torch.Tensor, out: torch.Tensor, x_amax: torch.Tensor | None = None
    ) -> bool:
        """out += dW: the fp8 product (fp32 where the GEMM gives it), then one add into the fp32 bucket slice;
        ``torch._scaled_mm`` cannot accumulate into its output, unlike the bf16 ``accumulate_mm``."""
        if not self.wgrad_fp8:
            accumulate_mm(out, g2d.t(), x2d)
            return True
        out.add_(self._wgrad(g2d, x2d, self._wide(g2d), x_amax))
        return True

    def _wide(self, g2d: torch.Tensor) -> torch.dtype:
        if g2d.is_cuda and self.recipe == "rowwise":
            return torch.bfloat16
        return torch.float32
