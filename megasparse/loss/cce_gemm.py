"""CCE on cuBLAS GEMMs over bounded vocabulary chunks, with the softmax maths fused in Triton (``backend="gemm"``).

The tile kernels of ``cce_kernels.py`` recompute logits in registers and add dE/dC under locks; at large hidden
sizes the locked read-modify-writes, not the FLOPs, are their cost (2× the materialised loss at D=4096). Here
every FLOP runs in a vendor GEMM and nothing is added under a lock:

* forward, per chunk of ``c`` vocabulary columns: S = H·W_cᵀ ([rows, c]), then ``_stats_kernel`` folds the
  chunk's log-sum-exp into the running one (fp32) and picks the target logit;
* backward, per chunk: S again, ``_grad_kernel`` forms P = gs·softmax(S − lse) − gt·onehot (times the softcap
  derivative) in fp32 and stores it in the input dtype over S, then dC_c = Pᵀ·H (written once: each vocabulary
  row lives in one chunk) and dE += P·W_c into an fp32 dE (a cuBLAS GEMM with fp32 output and beta = 1, rounded to
  the input dtype once at the end, as the materialised loss's one GEMM; decision 0207).

On sm_90+ in bf16/fp16 both logit passes run fused instead (``cce_fused.py``, decision 0204): the logit tiles stay in
registers, so neither S nor ``_stats_kernel``/``_grad_kernel`` is needed and the scratch holds P alone.

Memory is bounded by the chunk whatever the row count, so the [rows, V] logits never exist: the cuBLAS pass keeps S
(fp32) and P under ``CHUNK_BYTES`` (``backward_chunks``), the fused pass keeps P under ``P_BYTES`` and its forward's
tile partials under ``CHUNK_BYTES``. The work is 8·N·V·D FLOPs (the materialised loss does 6·N·V·D plus several
passes over fp32 logits): decision 0203 has the measurements. This path is exact: ``loss.filter_eps`` and
``sort_vocab`` belong to the tile kernels (block-sparse Triton GEMMs that skip the filtered P tiles were measured
slower than these dense cuBLAS ones, decision 0203). It has no host synchronisation: a captured CUDA graph replays it.
Same contract as ``reference.torch_shard_forward`` / ``torch_shard_backward``, which the tests compare it against.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from megasparse.loss import cce_fused
from megasparse.loss.cce_kernels import _capped, _p_tile, tl, triton
from megasparse.ops.wgrad import accumulate_mm

CHUNK_BYTES = 48 * 2**20
"""Bound on one chunk's scratch: S plus P, [rows, c] each (one buffer when S is in the input dtype)."""
LOGITS_FP32 = True
"""True (the default): S leaves the bf16 GEMM in fp32, the tile kernels' logit precision. False: S in the input dtype
(as the materialised losses, megatron-core's too, round logits) with P over it in place, so the scratch holds chunks
3× as wide: 3–8% faster on H100, but bf16 dC error against fp64 rises from 1.5e-2 to 6.6e-2 (decision 0203)."""
P_PER_S = 4
"""With S in fp32: P chunks span this many S sub-chunks (48 MB: S 512 and P 2048 columns at 8192 rows; the Llama-shape
backward took 40.8 ms against 42.5 at S = P = 1024 and 44.6 at S 768 / P 1536, H100)."""
P_BYTES = 56 * 2**20
"""Bound on the fused backward's one chunk buffer, P ([rows, c] in the input dtype): 3584 columns at 8192 rows, the
fastest of 44–60 MB on both shapes (H100, decision 0204); within the issue's 64 MB of extra memory. ``wave_cols``
picks the width under it."""
WAVE_WIDTH = True
"""True (the default): the fused backward's P width is ``wave_cols``'s, the width under ``P_BYTES`` whose GEMMs fill
the SMs in the fewest waves. False: the widest under ``P_BYTES`` (benchmarks compare the two; decision 0205)."""
_TILE = (128, 256)
"""Output tile of the backward's three GEMMs as ``wave_cols`` models them: the P pass's (``cce_fused.BWD``) and the
one cuBLAS's dC and dE times fit at these shapes (decision 0205)."""
_CHUNK_COST_K = 2048
"""A chunk's fixed cost (launch ramp and tail of its three GEMMs, dE read again) in ``wave_cols``'s unit: one wave
of tiles one K step deep. About 25 µs on an H100: it breaks near-ties towards fewer chunks."""
_MIN_COLS = 256

if triton is not None:

    @triton.jit
    def _stats_kernel(
        S, LSE, TGT_LOGIT, T, n, c, v0, stride_s, softcap,
        HAS_SOFTCAP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < n
        m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        s_i = tl.zeros([BLOCK_R], dtype=tl.float32)
        base = S + rows.to(tl.int64)[:, None] * stride_s
        for c0 in range(0, c, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            ok = row_ok[:, None] & (cols[None, :] < c)
            x = tl.load(base + cols[None, :], mask=ok, other=float("-inf")).to(tl.float32)
            x = tl.where(ok, _capped(x, softcap, HAS_SOFTCAP), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(x, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s_i = s_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), axis=1)
            m_i = m_new
        chunk = m_i + tl.log(s_i)
        old = tl.load(LSE + rows, mask=row_ok, other=0.0)
        hi = tl.maximum(old, chunk)
        hi_safe = tl.where(hi == float("-inf"), 0.0, hi)
        tl.store(LSE + rows, hi_safe + tl.log(tl.exp(old - hi_safe) + tl.exp(chunk - hi_safe)), mask=row_ok)
        t = tl.load(T + rows, mask=row_ok, other=-1) - v0
        inside = row_ok & (t >= 0) & (t < c)
        xt = tl.load(S + rows.to(tl.int64) * stride_s + t, mask=inside, other=0.0).to(tl.float32)
        xt = tl.where(inside, _capped(xt, softcap, HAS_SOFTCAP), 0.0)
        old_t = tl.load(TGT_LOGIT + rows, mask=row_ok, other=0.0)
        tl.store(TGT_LOGIT + rows, old_t + xt, mask=row_ok)

    @triton.jit
    def _grad_kernel(
        S, P, LSE, GS, GT, T, n, c, v0, stride_s, stride_p, softcap,
        HAS_SOFTCAP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        # P may alias S (same dtype): each program reads its tile before writing it, and tiles do not overlap
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        row_ok = rows < n
        ok = row_ok[:, None] & (cols[None, :] < c)
        r64 = rows.to(tl.int64)[:, None]
        x = tl.load(S + r64 * stride_s + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
        gs = tl.load(GS + rows, mask=row_ok, other=0.0)
        gt = tl.load(GT + rows, mask=row_ok, other=0.0)
        t = tl.load(T + rows, mask=row_ok, other=-1) - v0
        p = _p_tile(x, cols, lse, gs, gt, t, softcap, HAS_SOFTCAP)
        tl.store(P + r64 * stride_p + cols[None, :], p.to(P.dtype.element_ty), mask=ok)


def _s_dtype(h: Tensor) -> torch.dtype:
    return torch.float32 if LOGITS_FP32 or h.dtype == torch.float64 else h.dtype


def chunk_cols(n_rows: int, n_cols: int, bytes_per_col: int, budget: int | None = None, align: int = 128) -> int:
    """Vocabulary columns per chunk when each column costs ``bytes_per_col`` per row: within ``budget`` (a multiple of
    ``align`` so the GEMMs tile evenly; at least ``_MIN_COLS`` so a huge row count still gets GEMM-sized chunks)."""
    budget = CHUNK_BYTES if budget is None else budget
    c = budget // max(1, n_rows * bytes_per_col)
    c = max(_MIN_COLS, c // align * align)
    return min(c, n_cols)


@functools.lru_cache(maxsize=64)  # once per shape, not at every backward's launch
def wave_cols(n_rows: int, n_cols: int, d: int, cap: int, sms: int, align: int = 256) -> int:
    """The fused backward's P width: of the multiples of ``align`` in [cap / 2, cap], the one whose chunks' GEMMs take
    the fewest whole waves of ``_TILE`` tiles over ``sms`` SMs.

    Each chunk of c columns runs the P pass ([n, c], K = D), dC ([c, D], K = n) and dE ([n, D], K = c); a GEMM whose
    tiles leave the last wave part-empty costs that wave in full. At 8192 rows and D = 4096 the widest P under
    ``P_BYTES`` (3584 columns) gives dC 448 tiles, 3.4 waves on 132 SMs run as 4; 3072 columns give 384 (2.9):
    this model picks 3072 for Llama-3-8B and keeps 3584 for Gemma-2 (D = 2304), as measured (decision 0205)."""
    tm, tn = _TILE

    def cdiv(a: int, b: int) -> int:
        return -(-a // b)

    if n_cols <= cap:  # one chunk
        return cap
    cap = max(align, cap // align * align)

    def cost(c: int) -> int:
        total = 0
        for v0 in range(0, n_cols, c):
            cw = min(c, n_cols - v0)
            p_pass = cdiv(cdiv(n_rows, tm) * cdiv(cw, tn), sms) * d
            d_c = cdiv(cdiv(cw, tm) * cdiv(d, tn), sms) * n_rows
            d_e = cdiv(cdiv(n_rows, tm) * cdiv(d, tn), sms) * cw
            total += p_pass + d_c + d_e + _CHUNK_COST_K
        return total

    step = max(align, cap // 64 // align * align)  # at most ~32 candidates however wide the cap
    widths = range(cap, max(align, cap // 2) - 1, -step)
    return min(widths, key=lambda c: (cost(c), -c))


def fused_p_cols(n_rows: int, n_cols: int, d: int, elem_bytes: int, sms: int, budget: int | None = None) -> int:
    """The fused backward's P width: ``wave_cols``'s under ``budget`` bytes, ``P_BYTES`` by default (the widest there
    if not ``WAVE_WIDTH``)."""
    block = cce_fused.BWD.block_v
    cap = chunk_cols(n_rows, n_cols, elem_bytes, P_BYTES if budget is None else budget, block)
    return wave_cols(n_rows, n_cols, d, cap, sms, block) if WAVE_WIDTH else cap


def backward_chunks(
    n_rows: int, n_cols: int, elem_bytes: int, s_bytes: int, budget: int | None = None
) -> tuple[int, int]:
    """(S columns, P columns) of the backward within ``budget`` bytes (``CHUNK_BYTES`` by default). With S in fp32,
    P (the input dtype) spans ``P_PER_S`` S sub-chunks, so the dE GEMM's K is that much longer and dE is re-read and
    re-written that many times less (per chunk it costs [rows, D] of traffic: 3.4 of 14 ms on the Llama shape at 1024
    columns, H100). P over S in place: one width."""
    if s_bytes == elem_bytes:
        c = chunk_cols(n_rows, n_cols, elem_bytes, budget)
        return c, c
    cs = chunk_cols(n_rows, n_cols, s_bytes + P_PER_S * elem_bytes, budget)
    return cs, min(n_cols, P_PER_S * cs)


def _scratch(n: int, c: int, dtype: torch.dtype, device) -> Tensor:
    return torch.empty(n * c, dtype=dtype, device=device)


def _view(buf: Tensor, n: int, c: int) -> Tensor:
    """A contiguous [n, c] view at the start of a chunk buffer (the last chunk is narrower)."""
    return buf[: n * c].view(n, c)


def _mm_into(a: Tensor, b: Tensor, out: Tensor) -> Tensor:
    """a·b into ``out`` (fp32): a bf16/fp16 GEMM with fp32 output on CUDA (no rounding of the products' sum to
    the input dtype); off CUDA, where torch has no such GEMM, the product of the fp32 operands (the same sum)."""
    if a.dtype == out.dtype:
        return torch.mm(a, b, out=out)
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=out.dtype, out=out)
        except (TypeError, RuntimeError):  # torch without mm(out_dtype=): round through the input dtype
            return out.copy_(torch.mm(a, b))
    return torch.mm(a.to(out.dtype), b.to(out.dtype), out=out)


def _mm_add(a: Tensor, b: Tensor, out: Tensor) -> None:
    """out += a·b: one GEMM with beta = 1 (fp32 ``out``: fp32 output, no rounding to the input dtype, no
    temporary; decision 0207), or the fp32 operands' product added off CUDA, as ``_mm_into``."""
    if a.is_cuda or a.dtype == out.dtype:
        accumulate_mm(out, a, b)
    else:
        out.add_(torch.mm(a.to(out.dtype), b.to(out.dtype)))


def _blocks(h: Tensor, kind: str) -> tuple[int, int]:
    """(rows, columns) per program: the stats kernel loops over columns, so few rows each keep every SM busy."""
    if not h.is_cuda:
        return (16, 32)
    return (8, 512) if kind == "stats" else (32, 256)


def _fused(h: Tensor, w: Tensor, fused: bool | None) -> bool:
    """Whether a call takes the fused logit passes: where they are usable, unless told. Told to on a GPU where they
    cannot run (fp32 would silently run as TF32), it says so."""
    if fused is None:
        return cce_fused.usable(h, w)
    if fused and h.is_cuda and not cce_fused.usable(h, w):
        raise ValueError("fused CCE logit passes need sm_90+, bf16/fp16 h and w of one dtype, TMA-addressable rows")
    return fused


def gemm_shard_forward(
    h: Tensor,
    w: Tensor,
    tgt: Tensor,
    n_valid: int,
    softcap: float | None = None,
    chunk: int | None = None,
    fused: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """(lse [n] fp32, target logit [n] fp32, 0 where the target is in another shard) of this vocabulary slice.

    ``fused`` (default: where ``cce_fused.usable``) keeps the logit tiles in registers (``cce_fused.lse_pass``).
    ``chunk``: vocabulary columns per GEMM (cuBLAS pass) or per launch (fused pass, rounded up to whole tiles)."""
    n, _ = h.shape
    t32 = tgt.to(torch.int32).contiguous()
    if n > 0 and n_valid > 0 and _fused(h, w, fused):
        h, w = (x if cce_fused.tma_ok(x) else x.contiguous() for x in (h, w))  # no copy of a usable w
        budget = triton.cdiv(chunk, cce_fused.FWD.block_v) * n * 4 if chunk else CHUNK_BYTES
        return cce_fused.lse_pass(h, w, t32, n_valid, softcap, budget)
    lse = torch.full((n,), float("-inf"), dtype=torch.float32, device=h.device)
    tlogit = torch.zeros(n, dtype=torch.float32, device=h.device)
    if n == 0 or n_valid == 0:
        return lse, tlogit
    h = h.contiguous()
    s_dt = _s_dtype(h)
    c_max = chunk or chunk_cols(n, n_valid, s_dt.itemsize)
    buf = _scratch(n, c_max, s_dt, h.device)
    br, bc = _blocks(h, "stats")
    for v0 in range(0, n_valid, c_max):
        c = min(c_max, n_valid - v0)
        s = _mm_into(h, w[v0 : v0 + c].t(), _view(buf, n, c))
        _stats_kernel[(triton.cdiv(n, br),)](
            s, lse, tlogit, t32, n, c, v0, s.stride(0), float(softcap or 1.0),
            HAS_SOFTCAP=softcap is not None, BLOCK_R=br, BLOCK_C=bc, num_warps=4,
        )  # fmt: skip
    return lse, tlogit


def gemm_shard_backward(
    h: Tensor,
    w: Tensor,
    tgt: Tensor,
    lse: Tensor,
    gs: Tensor,
    gt: Tensor,
    n_valid: int,
    softcap: float | None = None,
    accum_fp32: bool = True,
    chunk: int | None = None,
    sub: int | None = None,
    dc_out: Tensor | None = None,
    fused: bool | None = None,
    scratch: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """(dE [n, D] in h.dtype, dC [V_local, D] in w.dtype) for dlogits = gs·softmax(S − lse) − gt·onehot(tgt).

    ``accum_fp32`` (the default) keeps the running dE in fp32 ([n, D]) and rounds it to the input dtype once, as the
    materialised loss's one long GEMM does; False rounds it after every chunk (at a 128K vocabulary ~40 times: ~10×
    the final norm's gradient error, decision 0207). ``chunk``/``sub`` override the P and S widths (tests, sweeps;
    ``sub`` is the cuBLAS pass's).
    ``dc_out`` (fp32): each chunk's dC GEMM adds into it (no compute-dtype dC, no cast, no separate add) and None is
    returned for dC. ``fused`` (default: where ``cce_fused.usable``) forms P in the logit GEMM's epilogue. ``scratch``:
    bytes the chunk buffer may take (``loss.cce_scratch_mb``; None: ``P_BYTES`` fused, ``CHUNK_BYTES`` otherwise)."""
    n, d = h.shape
    h, w = h.contiguous(), w.contiguous()
    d_c = None
    if dc_out is None:
        d_c = torch.empty_like(w)
        if n_valid < w.shape[0]:
            d_c[n_valid:].zero_()  # TP padding rows never get a gradient
    acc_dtype = torch.float32 if accum_fp32 else h.dtype
    if n == 0 or n_valid == 0:
        if d_c is not None:
            d_c.zero_()
        return torch.zeros(n, d, dtype=h.dtype, device=h.device), d_c
    d_e = torch.empty(n, d, dtype=acc_dtype, device=h.device)  # the first chunk writes it, the others add
    t32 = tgt.to(torch.int32).contiguous()
    lse, gs, gt = (x.float().contiguous() for x in (lse, gs, gt))
    if _fused(h, w, fused):  # P straight from the logit tiles in registers: no S buffer
        desc = cce_fused.Descriptors(h, w, cce_fused.BWD)
        cp = min(n_valid, chunk or fused_p_cols(n, n_valid, d, h.element_size(), desc.sms, scratch))
        p_buf = _scratch(n, cp, h.dtype, h.device)

        def fill(p: Tensor, v0: int) -> None:
            cce_fused.grad_pass(desc, t32, lse, gs, gt, v0, p, softcap)
    else:
        s_dt = _s_dtype(h)
        cs, cp = backward_chunks(n, n_valid, h.element_size(), s_dt.itemsize, scratch)
        cp = chunk or cp
        cs = min(cp, sub or (cp if s_dt == h.dtype else cs))
        s_buf = _scratch(n, cs, s_dt, h.device)
        inplace = s_dt == h.dtype and cs == cp  # P overwrites S
        p_buf = s_buf if inplace else _scratch(n, cp, h.dtype, h.device)
        br, bc = _blocks(h, "grad")

        def fill(p: Tensor, v0: int) -> None:
            c = p.shape[1]
            for s0 in range(0, c, cs):  # S sub-chunks fill P's columns
                cw = min(cs, c - s0)
                s = _mm_into(h, w[v0 + s0 : v0 + s0 + cw].t(), _view(s_buf, n, cw))
                ps = p[:, s0 : s0 + cw]
                _grad_kernel[(triton.cdiv(n, br), triton.cdiv(cw, bc))](
                    s, ps, lse, gs, gt, t32, n, cw, v0 + s0, s.stride(0), ps.stride(0), float(softcap or 1.0),
                    HAS_SOFTCAP=softcap is not None, BLOCK_R=br, BLOCK_C=bc, num_warps=4,
                )  # fmt: skip

    for v0 in range(0, n_valid, cp):
        c = min(cp, n_valid - v0)
        p = _view(p_buf, n, c)
        fill(p, v0)
        wc = w[v0 : v0 + c]
        if d_c is None:
            accumulate_mm(dc_out[v0 : v0 + c], p.t(), h)
        else:
            torch.mm(p.t(), h, out=d_c[v0 : v0 + c])
        if v0 == 0:
            _mm_into(p, wc, d_e)
        else:
            _mm_add(p, wc, d_e)
    return d_e.to(h.dtype), d_c
