"""Dynamic fp8 scaling: amax, a power-of-two scale and the scaled, saturating cast, as Triton kernels with a
pure-torch reference.

Scales are powers of two chosen from the current tensor's amax (``pow2_scale``): the largest 2^k with
amax·2^k ≤ the format's max. Why powers of two: multiplying by 2^k is exact, so the cast rounds once (the fp8
rounding itself) and dequantising is exact; the reference, the Triton kernel and the emulated GEMM then agree
bit for bit, which is what the tests check. It costs at most one binade of headroom below the format's max.
Everything happens on the device (no ``.item()``): a captured CUDA graph replays it, and the host never waits.

A non-finite amax gives a NaN scale, so an overflowing activation stays non-finite through the fp8 GEMM and the
trainer's non-finite guard sees it (saturation would have hidden an inf).

Axes (``axis``): ``tensor`` (one scale), ``row`` (one scale per row, amax over the columns) or ``col`` (one per
column, amax over the rows). ``transpose``: the output is the transposed [C, R] matrix (rows padded with zeros up
to ``pad_to``), the operand layout ``torch._scaled_mm`` wants for a weight-gradient GEMM whose reduction runs
over tokens.

``mask`` (bool, x's shape): quantise x ⊙ mask without making it: the kernels multiply each loaded value by its mask
bit (amax and cast alike), so the result is bit for bit ``quantize(x * mask)`` (-0 where a negative value is pruned,
NaN where a pruned one is not finite, as the product has) and a 2:4 weight's fp8 copies are made from W and M
directly (decision 1235).

Two launches per cast (an amax kernel with atomic maxima, then the cast kernel that computes the scale from it,
writes the fp8 values, optionally their transpose, and the inverse scales), plus the zeroing of the amax buffer.
One launch where the caller hands in an amax it computed before for the same tensor (``amax_triton``).
"""

from __future__ import annotations

import os
from typing import Literal

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs without triton use the reference
    triton = None

Axis = Literal["tensor", "row", "col"]
E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
EMAX = {E4M3: 8, E5M2: 15}
"""The format's max is 1.75·2^EMAX: 448 for e4m3fn, 57344 for e5m2."""
_GRID = {E4M3: (3, -6), E5M2: (2, -14)}  # (mantissa bits, smallest normal exponent): the kernel's rounding grid
_AXIS_ID = {"tensor": 0, "row": 1, "col": 2}
_TINY = 2.0**-100  # amax floor: an all-zero tensor gets a finite scale (its values stay zero)
TILES: dict[str, tuple[int, int, int]] = {"amax": (64, 128, 4), "cast": (16, 512, 4), "cast_t": (64, 64, 4)}
"""(rows, columns, warps) of one program of the amax kernel, the cast, and a cast that writes the transpose. Under
the interpreter any powers of two give the same bits (the tests sweep some); which is fastest is a GPU question that
``benchmarks/bench_fp8_cast.py`` answers per card, checking bits too. amax and cast are its fastest on an H200 at
8192 tokens of one 8B layer (``docs/benchmarks/data/bench_fp8_cast_h200.json``): 0.92x and 0.75x the 64x64x4
tiling's time. The transposing cast stays at 64x64x4: its fastest there (128x128, 8 warps, 0.96x) wrote wrong bits
for a masked bf16 weight on H100 and H200 under triton 3.6 (unmasked inputs matched; ``tests/test_gpu_fp8.py``)."""


def fp8_max(fmt: torch.dtype) -> float:
    return float(torch.finfo(fmt).max)


def pow2_scale(amax: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """The largest power of two s with amax·s ≤ max(fmt), from amax's float bits (exact: no log2); NaN where amax is
    not finite. fp32, amax's shape."""
    a = amax.float().clamp_min(_TINY)
    bits = a.view(torch.int32)
    e = (bits >> 23) - 127
    over = ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)  # mantissa above 1.75: one binade less
    k = (EMAX[fmt] - e - over).clamp(-126, 126)
    s = ((k + 127) << 23).view(torch.float32)
    return torch.where(torch.isfinite(a), s, torch.full_like(s, float("nan")))


def _amax(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    a = x.detach().abs().float()
    a = torch.where(torch.isnan(a), torch.full_like(a, float("inf")), a)
    if axis == "tensor":
        return a.amax() if a.numel() else a.new_zeros(())
    if a.numel() == 0:
        return a.new_zeros(a.shape[0] if axis == "row" else a.shape[1])
    return a.amax(dim=1 if axis == "row" else 0)


def quantize_reference(
    x: torch.Tensor,
    fmt: torch.dtype,
    axis: Axis = "tensor",
    transpose: bool = False,
    pad_to: int | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, inverse scale) of the 2-D ``x`` (times ``mask`` where given): q = sat(x·s) in ``fmt``, x ≈ q·s⁻¹. The
    inverse scale is 0-dim for ``tensor``, [R] for ``row``, [C] for ``col``. ``transpose``: q is [C, pad_to or R]
    (zero columns past R)."""
    if mask is not None:  # the definition the kernels are held to (here, on CPU, the product is made)
        x = x * mask
    s = pow2_scale(_amax(x, axis), fmt)
    b = s if axis == "tensor" else (s[:, None] if axis == "row" else s[None, :])
    m = fp8_max(fmt)
    q = (x.float() * b).clamp(-m, m).to(fmt)
    return (transposed(q, pad_to) if transpose else q), 1.0 / s


def transposed(q: torch.Tensor, pad_to: int | None = None) -> torch.Tensor:
    """qᵀ [C, pad_to or R] of an fp8 [R, C], zero-padded: the same bytes moved (through uint8, which every torch
    copies), no cast. The weight-gradient operand's layout, and fp8's per-use Wᵀ (``train.fp8_keep_transpose``)."""
    b = q.view(torch.uint8)
    if pad_to is None or pad_to == q.shape[0]:
        return b.t().contiguous().view(q.dtype)
    out = torch.zeros(q.shape[1], pad_to, dtype=torch.uint8, device=q.device)
    out[:, : q.shape[0]] = b.t()
    return out.view(q.dtype)


def dequantize(q: torch.Tensor, sinv: torch.Tensor, axis: Axis) -> torch.Tensor:
    """q·s⁻¹ in fp32 (exact: s⁻¹ is a power of two)."""
    b = sinv if axis == "tensor" else (sinv[:, None] if axis == "row" else sinv[None, :])
    return q.float() * b


if triton is not None:

    @triton.jit
    def _load(x_ptr, m_ptr, rows, cols, m, stride_r, stride_m, HAS_MASK: tl.constexpr):
        """The [BR, BC] tile of x in fp32, times its mask bits with ``HAS_MASK`` (x ⊙ M as ``x * mask`` gives it)."""
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_MASK:
            keep = tl.load(m_ptr + rows[:, None].to(tl.int64) * stride_m + cols[None, :], mask=m, other=0)
            x = x * keep.to(tl.float32)
        return x

    @triton.jit
    def _amax_kernel(
        x_ptr, m_ptr, out_ptr, R, C, stride_r, stride_m,
        AXIS: tl.constexpr, HAS_MASK: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        m = (rows[:, None] < R) & (cols[None, :] < C)
        x = _load(x_ptr, m_ptr, rows, cols, m, stride_r, stride_m, HAS_MASK)
        a = tl.abs(x)
        a = tl.where(a != a, float("inf"), a)  # NaN counts as inf: the scale turns NaN, the output stays non-finite
        if AXIS == 0:
            tl.atomic_max(out_ptr, tl.max(tl.max(a, axis=1), axis=0))
        elif AXIS == 1:
            tl.atomic_max(out_ptr + rows, tl.max(a, axis=1), mask=rows < R)
        else:
            tl.atomic_max(out_ptr + cols, tl.max(a, axis=0), mask=cols < C)

    @triton.jit
    def _pow2(amax, EMAXC: tl.constexpr):
        """(s, 1/s) exactly as ``pow2_scale`` computes them."""
        a = tl.maximum(amax, 7.888609052210118e-31)  # 2**-100
        bits = a.to(tl.int32, bitcast=True)
        e = (bits >> 23) - 127
        over = ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        k = EMAXC - e - over
        k = tl.minimum(tl.maximum(k, -126), 126)
        s = ((k + 127) << 23).to(tl.float32, bitcast=True)
        sinv = ((127 - k) << 23).to(tl.float32, bitcast=True)
        finite = a < float("inf")
        return tl.where(finite, s, float("nan")), tl.where(finite, sinv, float("nan"))

    @triton.jit
    def _round_to_grid(y, MBITS: tl.constexpr, EMIN: tl.constexpr):
        """y rounded to the nearest fp8 value (ties to even), still in fp32, so the fp8 store that follows is exact.
        Rounded here rather than by the store's conversion because the interpreter's fp32 → fp8 conversion does
        not round correctly (124.3 → 64 in e4m3; triton 3.9). The GPU's conversion (round to nearest even) gets
        values already on the grid, so it changes nothing there; both agree with torch's cast bit for bit."""
        bits = y.to(tl.int32, bitcast=True)
        e = tl.maximum(((bits >> 23) & 0xFF) - 127, EMIN) - MBITS  # the grid step at |y| is 2^e
        ulp = ((e + 127) << 23).to(tl.float32, bitcast=True)
        inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
        t = tl.abs(y) * inv  # exact (a power of two), |t| < 2^(MBITS+1)
        t = ((t + 12582912.0) - 12582912.0) * ulp  # 1.5·2^23: round to the nearest integer, ties to even
        sign = (bits >> 31) << 31  # y's sign bit (so -0 stays -0), kept in int32
        return (t.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _cast_kernel(
        x_ptr, m_ptr, amax_ptr, q_ptr, qt_ptr, sinv_ptr, R, C, stride_r, stride_m, ldt, FMAX,
        AXIS: tl.constexpr, HAS_MASK: tl.constexpr, WRITE_Q: tl.constexpr, WRITE_T: tl.constexpr,
        EMAXC: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
    ):  # fmt: skip
        pid_r, pid_c = tl.program_id(0), tl.program_id(1)
        rows = pid_r * BR + tl.arange(0, BR)
        cols = pid_c * BC + tl.arange(0, BC)
        rm, cm = rows < R, cols < C
        m = rm[:, None] & cm[None, :]
        x = _load(x_ptr, m_ptr, rows, cols, m, stride_r, stride_m, HAS_MASK)
        if AXIS == 0:
            s, sinv = _pow2(tl.load(amax_ptr), EMAXC)
            y = x * s
            if (pid_r == 0) & (pid_c == 0):
                tl.store(sinv_ptr, sinv)
        elif AXIS == 1:
            s, sinv = _pow2(tl.load(amax_ptr + rows, mask=rm, other=0.0), EMAXC)
            y = x * s[:, None]
            if pid_c == 0:
                tl.store(sinv_ptr + rows, sinv, mask=rm)
        else:
            s, sinv = _pow2(tl.load(amax_ptr + cols, mask=cm, other=0.0), EMAXC)
            y = x * s[None, :]
            if pid_r == 0:
                tl.store(sinv_ptr + cols, sinv, mask=cm)
        y = _round_to_grid(tl.clamp(y, -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL), MBITS, EMIN)
        if WRITE_Q:
            tl.store(q_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], y.to(q_ptr.dtype.element_ty), mask=m)
        if WRITE_T:  # rows R..ldt of the transpose are the zero padding (x loaded as 0 there)
            yt = tl.trans(y).to(qt_ptr.dtype.element_ty)
            mt = cm[:, None] & (rows < ldt)[None, :]
            tl.store(qt_ptr + cols[:, None].to(tl.int64) * ldt + rows[None, :], yt, mask=mt)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(x: torch.Tensor) -> bool:
    """Triton on the GPU, and on CPU only under TRITON_INTERPRET=1 (the tests); the torch reference elsewhere."""
    return triton is not None and (x.is_cuda or _interpreting())


def _mask_bytes(x: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """(mask as bytes, its row stride), or (x, 0) without one: the kernels' mask operand."""
    if mask is None:
        return x, 0
    if mask.dtype != torch.bool or mask.shape != x.shape:
        raise ValueError(f"quantize: the mask must be bool {list(x.shape)}, not {mask.dtype} {list(mask.shape)}")
    mask = (mask if mask.stride(-1) == 1 else mask.contiguous()).view(torch.uint8)  # one byte per element
    return mask, mask.stride(0)


def amax_triton(x: torch.Tensor, axis: Axis = "tensor", mask: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 amax buffer ``quantize_triton`` computes its scale from (NaN counted as inf), for a caller that
    casts the same ``x`` again later: a forward's input, cast once more, transposed, for its weight gradient, hands
    this to that cast as ``amax`` and skips the second read (``gemm.py``)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, sm = _mask_bytes(x, mask)
    r, c = x.shape
    amax = torch.zeros(1 if axis == "tensor" else (r if axis == "row" else c), dtype=torch.float32, device=x.device)
    br, bc, warps = TILES["amax"]
    if r and c:
        _amax_kernel[(triton.cdiv(r, br), triton.cdiv(c, bc))](
            x, m, amax, r, c, x.stride(0), sm, _AXIS_ID[axis], mask is not None, br, bc, num_warps=warps
        )
    return amax


def quantize_triton(
    x: torch.Tensor,
    fmt: torch.dtype,
    axis: Axis = "tensor",
    *,
    write_q: bool = True,
    transpose: bool = False,
    pad_to: int | None = None,
    mask: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """(q [R, C] or None, qᵀ [C, pad_to or R] or None, inverse scale) of the 2-D ``x`` (times the bool ``mask``
    where given): the values ``quantize_reference`` gives, from two kernels. ``write_q`` and ``transpose`` may both
    be set (a weight's two operand layouts from one read). ``amax``: ``amax_triton`` of this same ``x``, mask and
    axis, computed before; the amax kernel is then skipped (one kernel, one read of ``x``)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, sm = _mask_bytes(x, mask)  # checked before any kernel
    if transpose and x.dtype == torch.float32 and x.is_cuda:
        # triton 3.6 on sm_90 wrote every fourth row of the transposed fp8 block wrong from an fp32 input (bf16
        # inputs are exact; tests/test_gpu_fp8.py): fp32 inputs (weights, once per optimizer step) transpose in torch
        q, _, sinv = quantize_triton(x, fmt, axis, mask=mask, amax=amax)
        return (q if write_q else None), transposed(q, pad_to), sinv
    r, c = x.shape
    ldt = r if pad_to is None else pad_to
    n_scales = 1 if axis == "tensor" else (r if axis == "row" else c)
    if amax is None:
        amax = amax_triton(x, axis, mask)
    elif amax.shape != (n_scales,) or amax.dtype != torch.float32:
        raise ValueError(f"quantize: a given amax must be float32 [{n_scales}], not {amax.dtype} {list(amax.shape)}")
    sinv = torch.empty(n_scales, dtype=torch.float32, device=x.device)
    q = torch.empty(r, c, dtype=fmt, device=x.device) if write_q else None
    qt = torch.empty(c, ldt, dtype=fmt, device=x.device) if transpose else None
    br, bc, warps = TILES["cast_t" if transpose else "cast"]
    rows = max(r, ldt) if transpose else r
    if rows and c:
        _cast_kernel[(triton.cdiv(rows, br), triton.cdiv(c, bc))](
            x, m, amax, q if q is not None else sinv, qt if qt is not None else sinv, sinv, r, c, x.stride(0), sm,
            ldt, fp8_max(fmt), _AXIS_ID[axis], mask is not None, write_q, transpose, EMAX[fmt], *_GRID[fmt], br, bc,
            num_warps=warps,
        )  # fmt: skip
    elif axis == "tensor" or n_scales:
        sinv = 1.0 / pow2_scale(amax, fmt)
    return q, qt, sinv.reshape(()) if axis == "tensor" else sinv


def quantize(
    x: torch.Tensor,
    fmt: torch.dtype,
    axis: Axis = "tensor",
    transpose: bool = False,
    pad_to: int | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_reference``'s (q, inverse scale), from the Triton kernels where they run (``use_triton``)."""
    if not use_triton(x):
        return quantize_reference(x, fmt, axis, transpose, pad_to, mask)
    q, qt, sinv = quantize_triton(x, fmt, axis, write_q=not transpose, transpose=transpose, pad_to=pad_to, mask=mask)
    return (qt if transpose else q), sinv
