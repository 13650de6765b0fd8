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
from typing import Literal, NamedTuple

import torch

from megasparse.fp8.cast import (
    E4M3,
    E5M2,
    Axis,
    amax_triton,
    dequantize,
    quantize,
    quantize_triton,
    transposed,
    use_triton,
)
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


def _token_pad(x: torch.Tensor) -> int | None:
    """The weight-gradient GEMM's token dimension, padded to a multiple of 16 where ``torch._scaled_mm`` runs it
    (and under the Triton casts, whose tests stand in for it on CPU); None: unpadded (the emulation)."""
    return _pad16(x.shape[0]) if x.is_cuda or use_triton(x) else None


class Fp8Input(NamedTuple):
    """A linear's input as its weight gradient reads it (decision 1245): the e4m3 transpose xᵀ [K, tokens, padded
    where ``_token_pad`` pads] and its inverse scale, from the forward's cast."""

    qt: torch.Tensor
    s: torch.Tensor

    def rows(self, idx: torch.Tensor) -> Fp8Input:
        """The compact backward's kept rows ``idx`` (columns of xᵀ), re-padded for the GEMM; the scale stays the
        whole input's (a power of two: it changes no kept value's rounding above fp8's smallest normal)."""
        sel = self.qt.view(torch.uint8).index_select(1, idx)
        pad = _token_pad(sel.t())
        if pad is not None and pad != sel.shape[1]:
            sel = torch.nn.functional.pad(sel, (0, pad - sel.shape[1]))
        return Fp8Input(sel.view(self.qt.dtype), self.s)


class Fp8Gemm:
    """fp8 GEMMs of one linear layer (``parallel/layers.py``'s pluggable gemm), with its fp8 weight copies."""

    def __init__(
        self,
        param: torch.nn.Parameter,
        recipe: Recipe,
        wgrad_fp8: bool = False,
        source: Callable | None = None,
        save_input: bool = False,
        keep_transpose: bool = True,
    ) -> None:
        self.param, self.recipe, self.wgrad_fp8 = param, recipe, wgrad_fp8
        self.keep_transpose = keep_transpose or recipe != "tensorwise"
        """``train.fp8_keep_transpose``: Wᵀ e4m3 kept between steps; else (tensorwise: Wᵀ is W's bytes transposed,
        same scale) made at each ``dgrad`` from W and dropped after it."""
        self.save_input = save_input and recipe == "tensorwise" and wgrad_fp8
        """The layer keeps its input for the weight gradient as the forward's e4m3 transpose (``Fp8Input``), not in
        bf16 (decision 1245): tensorwise with the fp8 weight gradient only, where one scale serves both GEMMs. The
        converter sets it where nothing else keeps the bf16 input alive (``Fp8Converter.save_inputs``)."""
        self.source = source
        """What the fp8 copies are made from: None, the master; a 2:4 layer's ``weight_and_mask`` (W, M or None),
        whose W ⊙ M the casts read without a product being made (decision 1235)."""
        self.axis: Axis = "row" if recipe == "rowwise" else "tensor"
        self.w8: torch.Tensor | None = None  # W [N, K] e4m3, forward
        self.w8t: torch.Tensor | None = None  # Wᵀ [K, N] e4m3, dgrad (None: made per use, ``keep_transpose``)
        self.sw = self.swt = None  # their inverse scales (per row of each under rowwise)
        self.version: int | None = None
        self._g_t: tuple | None = None  # (g, gᵀ e5m2, scale): dgrad's cast handed to the wgrad that follows it
        self._x_amax: torch.Tensor | None = None  # the last fwd's input amax, until the layer takes it
        self._saved: tuple[torch.Tensor, torch.Tensor] | None = None  # the last fwd's (xᵀ e4m3, scale), the same

    # -- the weight's fp8 copies, once per optimizer step ------------------------------------------
    def refresh(self) -> None:
        """Quantise the current weight into the fp8 copies, in place (a captured step keeps reading the same
        buffers). The converter calls this after every optimizer step and checkpoint load."""
        w, m = (self.param.detach(), None) if self.source is None else self.source()
        if self.recipe == "tensorwise" and not self.keep_transpose:  # Wᵀ per use (``dgrad``)
            q, s = quantize(w, E4M3, "tensor", mask=m)
            qt, st = None, s
        elif self.recipe == "tensorwise" and use_triton(w):  # one scale: W and Wᵀ from one read
            q, qt, s = quantize_triton(w, E4M3, "tensor", transpose=True, mask=m)
            st = s
        elif self.recipe == "tensorwise":
            q, s = quantize(w, E4M3, "tensor", mask=m)
            qt, st = transposed(q), s
        else:
            q, s = quantize(w, E4M3, "row", mask=m)
            qt, st = quantize(w, E4M3, "col", transpose=True, mask=m)
        if self.w8 is None:
            self.w8, self.w8t, self.sw, self.swt = q, qt, s, st
        else:
            for buf, new in ((self.w8, q), (self.w8t, qt), (self.sw, s), (self.swt, st)):
                if new is not None:
                    buf.copy_(new)
        self.version = self.param._version

    def operand(self) -> torch.Tensor:
        """The layer's saved weight operand: the e4m3 W, refreshed on the spot if the master moved in place since
        the last copy (a fused optimizer does not move the version: the converter's ``refresh`` is the contract)."""
        if self.w8 is None or self.param._version != self.version:
            self.refresh()
        return self.w8

    # -- the three GEMMs ---------------------------------------------------------------------------
    def fwd(self, x2d: torch.Tensor, w: torch.Tensor, for_wgrad: bool = False) -> torch.Tensor:
        """y = x·Wᵀ; ``for_wgrad``: a weight gradient of this input will follow (the layer's autograd asks for it)."""
        self._x_amax = self._saved = None
        if for_wgrad and self.save_input:
            # one read of x writes both the forward operand and the weight gradient's xᵀ, which the layer keeps
            # instead of x (half the bytes; its backward then casts nothing of x)
            pad = _token_pad(x2d)
            if use_triton(x2d):
                q, qt, s = quantize_triton(x2d, E4M3, "tensor", transpose=True, pad_to=pad)
            else:
                q, s = quantize(x2d, E4M3, "tensor")
                qt = transposed(q, pad)
            self._saved = (qt, s)
            return scaled_mm(q, s, self.w8, self.sw, ("tensor", "tensor"), x2d.dtype)
        if self.recipe == "tensorwise" and self.wgrad_fp8 and use_triton(x2d):
            # the weight gradient casts this same x again (transposed, same single scale): its amax is kept for
            # that cast, which then skips its read of x (``take_x_amax``; the layer holds it until its backward)
            self._x_amax = amax_triton(x2d, "tensor")
            q, _, s = quantize_triton(x2d, E4M3, "tensor", amax=self._x_amax)
        else:
            q, s = quantize(x2d, E4M3, self.axis)
        return scaled_mm(q, s, self.w8, self.sw, (self.axis, self.axis), x2d.dtype)

    def take_saved_input(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What the layer saves instead of the input of the ``fwd`` just run (``save_input``; else None), once."""
        a, self._saved = self._saved, None
        return a

    def wgrad_input(self, saved: tuple[torch.Tensor, ...], idx: torch.Tensor | None = None) -> Fp8Input:
        """The weight gradient's input operand from what ``take_saved_input`` gave: all rows, or the kept ``idx``."""
        x = Fp8Input(*saved)
        return x if idx is None else x.rows(idx)

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
        wt = self.w8t if self.w8t is not None else transposed(self.w8)
        return scaled_mm(q, s, wt, self.swt, (self.axis, self.axis), g2d.dtype)

    def _wgrad(
        self,
        g2d: torch.Tensor,
        x2d: torch.Tensor | Fp8Input,
        out_dtype: torch.dtype,
        x_amax: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """dW = gᵀ·x in fp8 over the tokens: both operands quantised per feature (rowwise) into their transposes,
        the token dimension zero-padded to a multiple of 16 on CUDA. ``x_amax``: ``take_x_amax`` of the forward
        whose input ``x2d`` is, whole (never a compact backward's kept rows: their amax may be smaller). ``x2d``
        an ``Fp8Input``: xᵀ as the forward cast it, used as it is."""
        ax: Axis = "col" if self.recipe == "rowwise" else "tensor"
        pad = _token_pad(g2d)
        stash, self._g_t = self._g_t, None
        if stash is not None and stash[0] is g2d:
            gt, sg = stash[1], stash[2]
        else:
            gt, sg = quantize(g2d, E5M2, ax, transpose=True, pad_to=pad)
        if isinstance(x2d, Fp8Input):
            xt, sx = x2d
            if xt.shape[1] != (g2d.shape[0] if pad is None else pad):
                raise ValueError(f"fp8 wgrad: saved xᵀ {list(xt.shape)} does not match {g2d.shape[0]} gradient rows")
        elif x_amax is not None and ax == "tensor" and use_triton(x2d):
            _, xt, sx = quantize_triton(x2d, E4M3, "tensor", write_q=False, transpose=True, pad_to=pad, amax=x_amax)
        else:
            xt, sx = quantize(x2d, E4M3, ax, transpose=True, pad_to=pad)
        back: Axis = "row" if ax == "col" else "tensor"  # a column of g is a row of gᵀ
        return scaled_mm(gt, sg, xt, sx, (back, back), out_dtype)

    def wgrad(
        self, g2d: torch.Tensor, x2d: torch.Tensor | Fp8Input, x_amax: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not self.wgrad_fp8:
            return g2d.t() @ x2d
        return self._wgrad(g2d, x2d, self._wide(g2d), x_amax)

    def wgrad_into(
        self, g2d: torch.Tensor, x2d: torch.Tensor | Fp8Input, out: torch.Tensor, x_amax: torch.Tensor | None = None
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
