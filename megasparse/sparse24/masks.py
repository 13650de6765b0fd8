"""Optimal transposable 2:4 masks: per 4x4 block, the best of the 90 patterns with two
non-zeros in every row and column.

A transposable mask keeps W ⊙ M 2:4 along rows *and* columns, so the same sparse weight serves
the forward GEMM (X·S(W)ᵀ) and the input-gradient GEMM (∇Y·S(W)) on sparse tensor cores.
The reference scores every pattern at once as a product [blocks, 16] x [16, 90] of |W| with the
pattern table (the paper's "convolution") and takes the argmax. Two Triton kernels compute the
same mask: "dot" does that product on tensor cores; "pairs" (default) avoids the [blocks, 128]
score tile by scoring row pairs and combining rows 0-1 with the best rows-2-3 completion of each
column-demand class, all in registers (decision 0302). Both visit patterns in the reference's
order, so ties go to the lowest pattern index and masks are bit-identical whenever fp32 sums of
|W| are exact (bf16/fp16 weights of moderate range, integers); fp32 weights can differ only where
two patterns' scores differ below fp32 rounding. Kernels, launcher and reference live here together.
"""

from __future__ import annotations

import itertools
import math
import os

import torch

from megasparse.configbase import ConfigError

try:  # triton is optional: CPU CI without it uses the torch reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None

NUM_PATTERNS = 90
_PAD_PATTERNS = 128  # tl.dot wants power-of-two widths; columns >= 90 score -inf


def _enumerate_patterns() -> torch.Tensor:
    """All 4x4 0/1 matrices with exactly two ones per row and per column, as [90, 16] rows."""
    pairs = list(itertools.combinations(range(4), 2))
    out = []
    for rows in itertools.product(pairs, repeat=4):
        m = [[0] * 4 for _ in range(4)]
        for r, (a, b) in enumerate(rows):
            m[r][a] = m[r][b] = 1
        if all(sum(m[r][c] for r in range(4)) == 2 for c in range(4)):
            out.append([v for row in m for v in row])
    t = torch.tensor(out, dtype=torch.float32)
    assert t.shape == (NUM_PATTERNS, 16)
    return t


PATTERNS = _enumerate_patterns()
"""[90, 16] float32: row p is pattern p flattened row-major (element (i, j) at i*4+j)."""
_PATTERN_CODES = (PATTERNS.to(torch.int64) * (2 ** torch.arange(16))).sum(1).to(torch.int32)
_device_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def check_mask_shape(shape: tuple[int, ...] | torch.Size, name: str = "weight") -> None:
    """Raise a one-line ConfigError unless ``shape`` is 2-D with both sides multiples of 4."""
    if len(shape) != 2 or shape[0] % 4 or shape[1] % 4 or shape[0] == 0 or shape[1] == 0:
        raise ConfigError(
            f"sparsity: {name} has shape {list(shape)}; transposable 2:4 masks need a 2-D weight (shard) whose "
            "rows and columns are both multiples of 4 — make hidden_size and ffn_hidden_size/tp multiples of 4"
        )


# cuSPARSELt on sm_90 through torch: sparse operand rows/cols multiples of 16 (torch's constraint for fp16/bf16),
# _sparse_semi_structured_apply wants 32-aligned columns, and both W and Wᵀ are compressed. 64 on both sides
# satisfies all of them and every real FFN shape.
CUSPARSELT_ALIGN = 64


def check_cusparselt_shape(shape: tuple[int, ...] | torch.Size, name: str = "weight") -> None:
    """Raise a one-line ConfigError unless both sides of a weight (shard) suit cuSPARSELt's 2:4 GEMMs."""
    check_mask_shape(shape, name)
    if shape[0] % CUSPARSELT_ALIGN or shape[1] % CUSPARSELT_ALIGN:
        raise ConfigError(
            f"sparsity: {name} shard has shape {list(shape)}; the cuSPARSELt backend needs both sides to be "
            f"multiples of {CUSPARSELT_ALIGN} — use sparsity.backend=emulate or pick hidden_size and "
            f"ffn_hidden_size/tp as multiples of {CUSPARSELT_ALIGN}"
        )


def transposable_mask_reference(w: torch.Tensor) -> torch.Tensor:
    """Pure-torch optimal transposable mask (fp64 scoring): bool tensor shaped like ``w``."""
    check_mask_shape(w.shape)
    r, c = w.shape
    blocks = w.detach().abs().to(torch.float64).reshape(r // 4, 4, c // 4, 4).permute(0, 2, 1, 3).reshape(-1, 16)
    scores = blocks @ PATTERNS.to(device=w.device, dtype=torch.float64).t()
    best = scores.argmax(dim=1)
    mask = PATTERNS.to(w.device)[best].bool()
    return mask.reshape(r // 4, c // 4, 4, 4).permute(0, 2, 1, 3).reshape(r, c)


def kept_magnitude(w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-4x4-block sum of |w| kept by ``mask`` (fp64), for comparing masks that tie."""
    r, c = w.shape
    kept = (w.detach().abs().to(torch.float64) * mask).reshape(r // 4, 4, c // 4, 4)
    return kept.sum(dim=(1, 3))


def is_transposable_24(mask: torch.Tensor) -> bool:
    """True when every row and column of every 4x4 block holds exactly two kept entries."""
    r, c = mask.shape
    b = mask.reshape(r // 4, 4, c // 4, 4).to(torch.int32)
    return bool((b.sum(dim=3) == 2).all() and (b.sum(dim=1) == 2).all())


if triton is not None:

    @triton.jit
    def _score(a, pat, DOT: tl.constexpr):
        if DOT == 0:  # fp32 operands, full precision (fp32 weights, and the CPU interpreter)
            return tl.dot(a.to(tl.float32), pat, input_precision="ieee")
        # bf16/fp16 |w| times exact 0/1 on tensor cores, fp32 accumulation: exact products
        return tl.dot(a, pat.to(a.dtype))

    @triton.jit
    def _mask_kernel(
        w_ptr,
        mask_ptr,
        pat_ptr,
        code_ptr,
        n_rows,
        n_cols,
        stride_w,
        stride_m,
        BR: tl.constexpr,
        BB: tl.constexpr,
        NPAT: tl.constexpr,
        PADP: tl.constexpr,
        DOT: tl.constexpr,
        GATHER: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
        # One program: BR x BB 4x4 blocks (4*BR rows, 4*BB columns).
        NB: tl.constexpr = BR * BB
        k = tl.arange(0, 16)
        if GATHER:  # address the [NB, 16] block view directly: 8-byte vector loads, no register shuffles
            b = tl.arange(0, NB)
            rows = (tl.program_id(0) * BR + b // BB)[:, None] * 4 + (k // 4)[None, :]
            cols = (tl.program_id(1) * BB + b % BB)[:, None] * 4 + (k % 4)[None, :]
            inb = (rows < n_rows) & (cols < n_cols)
            w = tl.load(w_ptr + rows * stride_w + cols, mask=inb, other=0.0)
            a = tl.abs(w)
        else:  # load a dense [4BR, 4BB] tile (fully coalesced), then regroup it into blocks
            rows = tl.program_id(0) * (4 * BR) + tl.arange(0, 4 * BR)
            cols = tl.program_id(1) * (4 * BB) + tl.arange(0, 4 * BB)
            inb = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
            w = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :], mask=inb, other=0.0)
            a = tl.reshape(tl.permute(tl.reshape(tl.abs(w), (BR, 4, BB, 4)), (0, 2, 1, 3)), (NB, 16))
        if SPLIT:  # 90 = 64 + 26: two dots of widths 64 and 32 score 96 columns instead of 128
            p1 = tl.arange(0, 64)
            p2 = tl.arange(0, 32)
            s1 = _score(a, tl.load(pat_ptr + k[:, None] * PADP + p1[None, :]), DOT)
            s2 = _score(a, tl.load(pat_ptr + k[:, None] * PADP + 64 + p2[None, :]), DOT)
            s2 = tl.where(p2[None, :] < NPAT - 64, s2, -1.0)
            b1 = tl.argmax(s1, axis=1)
            b2 = tl.argmax(s2, axis=1)
            best = tl.where(tl.max(s2, axis=1) > tl.max(s1, axis=1), b2 + 64, b1)  # ties: lower index, like argmax
        else:
            p = tl.arange(0, PADP)
            scores = _score(a, tl.load(pat_ptr + k[:, None] * PADP + p[None, :]), DOT)  # [NB, PADP]
            scores = tl.where(p[None, :] < NPAT, scores, -1.0)
            best = tl.argmax(scores, axis=1)  # [NB]; first maximum wins, like torch.argmax
        code = tl.load(code_ptr + best)  # 16-bit pattern code per block
        bits = ((code[:, None] >> k[None, :]) & 1).to(tl.uint8)  # [NB, 16]
        if GATHER:
            tl.store(mask_ptr + rows * stride_m + cols, bits, mask=inb)
        else:
            out = tl.reshape(tl.permute(tl.reshape(bits, (BR, BB, 4, 4)), (0, 2, 1, 3)), (4 * BR, 4 * BB))
            tl.store(mask_ptr + rows[:, None] * stride_m + cols[None, :], out, mask=inb)

    @triton.jit
    def _best2(v0, c0, v1, c1):
        """Keep candidate 1 only if strictly better: the earlier candidate wins ties, like torch.argmax."""
        t = v1 > v0
        return tl.where(t, v1, v0), tl.where(t, c1, c0)

    @triton.jit
    def _best6(v0, c0, v1, c1, v2, c2, v3, c3, v4, c4, v5, c5):
        v, c = _best2(v0, c0, v1, c1)
        v, c = _best2(v, c, v2, c2)
        v, c = _best2(v, c, v3, c3)
        v, c = _best2(v, c, v4, c4)
        return _best2(v, c, v5, c5)

    @triton.jit
    def _row_pairs(p, ok, BR: tl.constexpr, BB: tl.constexpr, VEC: tl.constexpr):
        """One row of every block in the tile: its six two-of-four |w| sums (pairs 01 02 03 12 13 23), fp32."""
        if VEC:  # one 4-element (8-byte for bf16) load per block row, split in registers
            x = tl.load(p[:, :, None] + tl.arange(0, 4)[None, None, :], mask=ok[:, :, None], other=0.0)
            even, odd = tl.split(tl.reshape(tl.abs(x.to(tl.float32)), (BR, BB, 2, 2)))  # columns (0, 2), (1, 3)
            x0, x2 = tl.split(even)
            x1, x3 = tl.split(odd)
        else:  # four strided scalar loads; the block's other columns come from the same cache lines
            x0 = tl.abs(tl.load(p, mask=ok, other=0.0).to(tl.float32))
            x1 = tl.abs(tl.load(p + 1, mask=ok, other=0.0).to(tl.float32))
            x2 = tl.abs(tl.load(p + 2, mask=ok, other=0.0).to(tl.float32))
            x3 = tl.abs(tl.load(p + 3, mask=ok, other=0.0).to(tl.float32))
        return x0 + x1, x0 + x2, x0 + x3, x1 + x2, x1 + x3, x2 + x3

    @triton.jit
    def _row_word(code, i: tl.constexpr):
        """Row i's nibble of the 16-bit pattern code spread to four 0/1 bytes (one little-endian int32)."""
        n = (code >> (4 * i)) & 15
        return (n * 0x204081) & 0x01010101  # bit j -> bit 8j; the four shifted copies never overlap

    @triton.jit
    def _mask_pairs_kernel(
        w_ptr,
        mask_ptr,
        n_brows,
        n_bcols,
        stride_w,
        stride_m,
        BR: tl.constexpr,
        BB: tl.constexpr,
        VEC: tl.constexpr,
    ):
        # One program: a [BR, BB] tile of 4x4 blocks, every quantity an fp32 [BR, BB] register tensor.
        # Rows 0-1 pick pairs p0, p1 (36 combos), leaving rows 2-3 a column demand d = 2 - count(p0, p1) with
        # entries 0..2 summing to 4: 19 classes, 6 of kind "both rows take pair q" (ta), 12 of kind "column x twice,
        # column w never" (tb{x}{w}: 2 completions) and 1 of kind "each column once" (tc: 6 completions). Each
        # class's best completion is found once; then the 36 combos are scanned grouped by p0. Candidates are
        # visited in lexicographic (p0, p1, p2, p3) order with strict '>' everywhere, which is the order of
        # PATTERNS, so ties resolve to the lowest pattern index exactly as the reference's argmax does.
        # Codes: bits 4i..4i+3 are row i's kept columns (0x3 = cols 0,1; 0x5 = 0,2; 0x9 = 0,3; 0x6 = 1,2; ...).
        brow = tl.program_id(0) * BR + tl.arange(0, BR)[:, None]
        bcol = tl.program_id(1) * BB + tl.arange(0, BB)[None, :]
        ok = (brow < n_brows) & (bcol < n_bcols)
        p = w_ptr + (4 * brow) * stride_w + 4 * bcol
        s0_01, s0_02, s0_03, s0_12, s0_13, s0_23 = _row_pairs(p, ok, BR, BB, VEC)
        s1_01, s1_02, s1_03, s1_12, s1_13, s1_23 = _row_pairs(p + stride_w, ok, BR, BB, VEC)
        s2_01, s2_02, s2_03, s2_12, s2_13, s2_23 = _row_pairs(p + 2 * stride_w, ok, BR, BB, VEC)
        s3_01, s3_02, s3_03, s3_12, s3_13, s3_23 = _row_pairs(p + 3 * stride_w, ok, BR, BB, VEC)
        # fmt: off
        ta01 = s2_01 + s3_01
        ta02 = s2_02 + s3_02
        ta03 = s2_03 + s3_03
        ta12 = s2_12 + s3_12
        ta13 = s2_13 + s3_13
        ta23 = s2_23 + s3_23
        tb01, kb01 = _best2(s2_02 + s3_03, 0x9500, s2_03 + s3_02, 0x5900)
        tb02, kb02 = _best2(s2_01 + s3_03, 0x9300, s2_03 + s3_01, 0x3900)
        tb03, kb03 = _best2(s2_01 + s3_02, 0x5300, s2_02 + s3_01, 0x3500)
        tb10, kb10 = _best2(s2_12 + s3_13, 0xA600, s2_13 + s3_12, 0x6A00)
        tb12, kb12 = _best2(s2_01 + s3_13, 0xA300, s2_13 + s3_01, 0x3A00)
        tb13, kb13 = _best2(s2_01 + s3_12, 0x6300, s2_12 + s3_01, 0x3600)
        tb20, kb20 = _best2(s2_12 + s3_23, 0xC600, s2_23 + s3_12, 0x6C00)
        tb21, kb21 = _best2(s2_02 + s3_23, 0xC500, s2_23 + s3_02, 0x5C00)
        tb23, kb23 = _best2(s2_02 + s3_12, 0x6500, s2_12 + s3_02, 0x5600)
        tb30, kb30 = _best2(s2_13 + s3_23, 0xCA00, s2_23 + s3_13, 0xAC00)
        tb31, kb31 = _best2(s2_03 + s3_23, 0xC900, s2_23 + s3_03, 0x9C00)
        tb32, kb32 = _best2(s2_03 + s3_13, 0xA900, s2_13 + s3_03, 0x9A00)
        tc, kc = _best6(
            s2_01 + s3_23, 0xC300, s2_02 + s3_13, 0xA500, s2_03 + s3_12, 0x6900,
            s2_12 + s3_03, 0x9600, s2_13 + s3_02, 0x5A00, s2_23 + s3_01, 0x3C00,
        )
        g01, h01 = _best6(
            s1_01 + ta23, 0xCC30, s1_02 + tb30, 0x0050 | kb30, s1_03 + tb20, 0x0090 | kb20,
            s1_12 + tb31, 0x0060 | kb31, s1_13 + tb21, 0x00A0 | kb21, s1_23 + tc, 0x00C0 | kc,
        )
        g02, h02 = _best6(
            s1_01 + tb30, 0x0030 | kb30, s1_02 + ta13, 0xAA50, s1_03 + tb10, 0x0090 | kb10,
            s1_12 + tb32, 0x0060 | kb32, s1_13 + tc, 0x00A0 | kc, s1_23 + tb12, 0x00C0 | kb12,
        )
        g03, h03 = _best6(
            s1_01 + tb20, 0x0030 | kb20, s1_02 + tb10, 0x0050 | kb10, s1_03 + ta12, 0x6690,
            s1_12 + tc, 0x0060 | kc, s1_13 + tb23, 0x00A0 | kb23, s1_23 + tb13, 0x00C0 | kb13,
        )
        g12, h12 = _best6(
            s1_01 + tb31, 0x0030 | kb31, s1_02 + tb32, 0x0050 | kb32, s1_03 + tc, 0x0090 | kc,
            s1_12 + ta03, 0x9960, s1_13 + tb01, 0x00A0 | kb01, s1_23 + tb02, 0x00C0 | kb02,
        )
        g13, h13 = _best6(
            s1_01 + tb21, 0x0030 | kb21, s1_02 + tc, 0x0050 | kc, s1_03 + tb23, 0x0090 | kb23,
            s1_12 + tb01, 0x0060 | kb01, s1_13 + ta02, 0x55A0, s1_23 + tb03, 0x00C0 | kb03,
        )
        g23, h23 = _best6(
            s1_01 + tc, 0x0030 | kc, s1_02 + tb12, 0x0050 | kb12, s1_03 + tb13, 0x0090 | kb13,
            s1_12 + tb02, 0x0060 | kb02, s1_13 + tb03, 0x00A0 | kb03, s1_23 + ta01, 0x33C0,
        )
        _, code = _best6(
            s0_01 + g01, h01 | 0x0003, s0_02 + g02, h02 | 0x0005, s0_03 + g03, h03 | 0x0009,
            s0_12 + g12, h12 | 0x0006, s0_13 + g13, h13 | 0x000A, s0_23 + g23, h23 | 0x000C,
        )
        # fmt: on
        # the mask is written as int32 words (4 bytes of one block row), so each store is one coalesced word per block
        q = mask_ptr + (4 * brow) * stride_m + bcol
        tl.store(q, _row_word(code, 0), mask=ok)
        tl.store(q + stride_m, _row_word(code, 1), mask=ok)
        tl.store(q + 2 * stride_m, _row_word(code, 2), mask=ok)
        tl.store(q + 3 * stride_m, _row_word(code, 3), mask=ok)


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (device.type, device.index)
    if key not in _device_tables:
        pat = torch.zeros(16, _PAD_PATTERNS, dtype=torch.float32)
        pat[:, :NUM_PATTERNS] = PATTERNS.t()
        _device_tables[key] = (pat.to(device), _PATTERN_CODES.to(device))
    return _device_tables[key]


MASK_KERNEL_CONFIG = {"br": 2, "bb": 64, "gather": True, "split": False, "num_warps": 4}
"""Launch shape of the "dot" mask kernel (from the H100 sweep in benchmarks/bench_sparse24.py)."""

PAIRS_KERNEL_CONFIG = {"br": 1, "bb": 128, "vec": False, "num_warps": 4}
"""Launch shape of the "pairs" mask kernel: br x bb blocks per program, vec = one 4-wide load per block row.
Fastest of 9 swept on an H200 (69% of copy bandwidth on 28672x4096; docs/benchmarks/sparse24.md)."""

MASK_KERNEL = "pairs"
"""Default Triton mask kernel: "pairs" (row-pair scores + best completion per column-demand class, registers
only) or "dot" (all 90 patterns scored by one tl.dot). Both return the reference's mask, ties included."""
MASK_KERNELS = ("pairs", "dot")


def _launch_pairs(w: torch.Tensor, cfg: dict) -> torch.Tensor:
    r, c = w.shape
    if w.dtype == torch.float64:
        w = w.float()
    bb = min(cfg["bb"], triton.next_power_of_2(c // 4))
    br = min(cfg["br"], triton.next_power_of_2(r // 4))
    words = torch.empty(r, c // 4, dtype=torch.int32, device=w.device)  # 4 mask bytes of one block row per word
    grid = (triton.cdiv(r // 4, br), triton.cdiv(c // 4, bb))
    _mask_pairs_kernel[grid](
        w, words, r // 4, c // 4, w.stride(0), words.stride(0), BR=br, BB=bb, VEC=bool(cfg["vec"]),
        num_warps=cfg["num_warps"],
    )  # fmt: skip
    return words.view(torch.uint8).view(torch.bool)  # little-endian: byte j of a word is column 4*block + j


def transposable_mask_triton(
    w: torch.Tensor,
    br: int | None = None,
    bb: int | None = None,
    gather: bool | None = None,
    num_warps: int | None = None,
    split: bool | None = None,
    kernel: str | None = None,
    vec: bool | None = None,
) -> torch.Tensor:
    """Triton launcher: one program per br x bb 4x4 blocks; returns a bool mask equal to the reference's.

    ``kernel`` picks "pairs" or "dot" (default ``MASK_KERNEL``); ``gather``/``split`` apply to "dot" only,
    ``vec`` to "pairs" only. Both kernels score in fp32, so fp32 weights whose patterns differ by less than
    fp32 rounding may pick another (equally optimal up to rounding) pattern than the fp64 reference.
    """
    if triton is None:
        raise RuntimeError("triton is not installed; use transposable_mask_reference")
    check_mask_shape(w.shape)
    kernel = MASK_KERNEL if kernel is None else kernel
    if kernel not in MASK_KERNELS:
        raise ConfigError(f"sparsity: mask kernel {kernel!r} is unknown; use one of {list(MASK_KERNELS)}")
    w = w.detach()
    if w.stride(1) != 1:
        w = w.contiguous()
    given = dict(br=br, bb=bb, gather=gather, num_warps=num_warps, split=split, vec=vec)
    if kernel == "pairs":
        cfg = dict(PAIRS_KERNEL_CONFIG)
        cfg.update({k: v for k, v in given.items() if v is not None and k in cfg})
        return _launch_pairs(w, cfg)
    cfg = dict(MASK_KERNEL_CONFIG)
    cfg.update({k: v for k, v in given.items() if v is not None and k in cfg})
    r, c = w.shape
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if w.dtype in (torch.bfloat16, torch.float16) and not interp:
        dot = 1
    else:
        dot = 0
        if w.dtype == torch.float64:
            w = w.float()
    bb_ = min(cfg["bb"], max(4, triton.next_power_of_2(c // 4)))
    br_ = min(cfg["br"], max(1, triton.next_power_of_2(r // 4)))
    while br_ * bb_ < 16:  # tl.dot needs at least 16 rows
        bb_ *= 2
    out = torch.empty(r, c, dtype=torch.uint8, device=w.device)
    pat, codes = _tables(w.device)
    grid = (math.ceil(r / (4 * br_)), math.ceil(c / (4 * bb_)))
    _mask_kernel[grid](
        w, out, pat, codes, r, c, w.stride(0), out.stride(0), BR=br_, BB=bb_, NPAT=NUM_PATTERNS,
        PADP=_PAD_PATTERNS, DOT=dot, GATHER=bool(cfg["gather"]), SPLIT=bool(cfg["split"]), num_warps=cfg["num_warps"],
    )  # fmt: skip
    return out.view(torch.bool)


def transposable_mask(w: torch.Tensor) -> torch.Tensor:
    """Optimal transposable 2:4 mask of ``w`` [rows, cols] (both multiples of 4): Triton on GPU, torch on CPU."""
    if w.is_cuda and triton is not None:
        return transposable_mask_triton(w)
    return transposable_mask_reference(w)
