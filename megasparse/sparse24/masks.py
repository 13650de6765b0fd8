"""Optimal transposable 2:4 masks: per 4x4 block, the best of the 90 patterns with two
non-zeros in every row and column.

A transposable mask keeps W ⊙ M 2:4 along rows *and* columns, so the same sparse weight serves
the forward GEMM (X·S(W)ᵀ) and the input-gradient GEMM (∇Y·S(W)) on sparse tensor cores.
Every pattern is scored at once as a product [blocks, 16] x [16, 90] of |W| with the pattern
table (the paper's "convolution"), then the argmax pattern is written back. The Triton kernel,
its launcher and a pure-torch reference live here together; tests compare them.
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


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (device.type, device.index)
    if key not in _device_tables:
        pat = torch.zeros(16, _PAD_PATTERNS, dtype=torch.float32)
        pat[:, :NUM_PATTERNS] = PATTERNS.t()
        _device_tables[key] = (pat.to(device), _PATTERN_CODES.to(device))
    return _device_tables[key]


MASK_KERNEL_CONFIG = {"br": 2, "bb": 64, "gather": True, "split": False, "num_warps": 4}
"""Launch shape of the mask kernel (from the H100 sweep in benchmarks/bench_sparse24.py)."""


def transposable_mask_triton(
    w: torch.Tensor,
    br: int | None = None,
    bb: int | None = None,
    gather: bool | None = None,
    num_warps: int | None = None,
    split: bool | None = None,
) -> torch.Tensor:
    """Triton launcher: one program per br x bb 4x4 blocks; returns a bool mask."""
    if triton is None:
        raise RuntimeError("triton is not installed; use transposable_mask_reference")
    check_mask_shape(w.shape)
    cfg = dict(MASK_KERNEL_CONFIG)
    cfg.update(
        {k: v for k, v in dict(br=br, bb=bb, gather=gather, num_warps=num_warps, split=split).items() if v is not None}
    )
    w = w.detach()
    if w.stride(1) != 1:
        w = w.contiguous()
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
