"""Cut Cross-Entropy on one vocabulary shard: Triton kernels, their launchers, the autograd Function.

Forward (``_fwd_kernel``): each program owns a block of rows and a contiguous range of vocabulary
blocks, recomputes logit tiles in registers, keeps an online log-sum-exp and picks the target logit
on the fly; it writes one partial (lse, target logit) per row and split, a [splits, n] buffer merged
by a tiny logsumexp. No spin lock, no [n, V] tensor, deterministic.

Backward (``_bwd_kernel``): one program per (row block, vocabulary block) recomputes the tile, forms
gs·softmax (minus gt at the targets in exact mode), skips the tile when every softmax entry is below
``filter_eps``, and otherwise adds its dE and dC contributions with vectorised read-modify-writes under
per-(block, D-chunk) spin locks. Programs that share a vocabulary block are launched together so the
classifier tile is read from HBM once. In exact mode (no filtering) the locks become tickets that fix the
order of the adds, so exact-mode gradients are bitwise reproducible on the GPU too. With filtering, the
one-hot part (−gt at each row's target) is added by ``add_target_term``, a row-owned pass: inside the tile
kernel it would force every tile holding a target through the locked adds. With filtering on, the
vocabulary is walked in ``vocab_order`` (descending mean logit) so small columns share tiles and whole
tiles are skipped.

``shard_forward`` / ``shard_backward`` are the split pieces a pipeline-vocabulary caller needs (lse
partial + target logit partial; backward for a given merged lse); they pick Triton on CUDA, the
chunked torch reference (``reference.py``) on CPU, or Triton anywhere when MEGASPARSE_CCE_BACKEND=triton
(CPU tests use that with TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from megasparse.loss.reference import torch_shard_backward, torch_shard_forward
from megasparse.parallel import comm

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU images without triton use the torch path
    triton = None
    tl = None


@dataclass(frozen=True)
class KernelConfig:
    """Tile shape and pipelining of one kernel (chosen on H100/H200, see docs/benchmarks/cce.md)."""

    block_m: int = 128
    block_v: int = 128
    block_d: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8
    """Backward only: row blocks that visit each vocabulary tile back to back."""
    mm_block_d: int = 0
    """Backward only: D chunk of the dE/dC read-modify-writes (0: ``block_d``); each chunk has its own lock."""


FWD_CONFIG = KernelConfig(128, 256, 64, 8, 3)
BWD_CONFIG = KernelConfig(128, 128, 64, 4, 3, 16, 128)
_SMALL = KernelConfig(16, 32, 16, 4, 1, 2)  # interpreter / tiny problems
# fp32 inputs: the bf16 tiles' shared-memory pipeline (3 stages of 4-byte tiles) exceeds Hopper's 227 KB
_FP32 = {"fwd": KernelConfig(128, 256, 32, 8, 2), "bwd": KernelConfig(128, 128, 64, 8, 2, 8)}


def backend_for(t: Tensor) -> str:
    """triton on CUDA, torch on CPU; MEGASPARSE_CCE_BACKEND forces one (tests run Triton interpreted)."""
    forced = os.environ.get("MEGASPARSE_CCE_BACKEND", "")
    if forced in ("triton", "torch"):
        return forced if (forced == "torch" or triton is not None) else "torch"
    return "triton" if (t.is_cuda and triton is not None) else "torch"


if triton is not None:

    @triton.jit
    def _tile_logits(
        E, C, rows, cols, row_ok, col_ok, D, stride_e, stride_c,
        BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):  # fmt: skip
        acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
        offs_d = tl.arange(0, BLOCK_D)
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + offs_d
            if EVEN_D:
                e = tl.load(E + rows[:, None] * stride_e + dd[None, :], mask=row_ok[:, None], other=0.0)
                c = tl.load(C + cols[:, None] * stride_c + dd[None, :], mask=col_ok[:, None], other=0.0)
            else:
                d_ok = dd < D
                e = tl.load(E + rows[:, None] * stride_e + dd[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
                c = tl.load(C + cols[:, None] * stride_c + dd[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            acc = tl.dot(e, tl.trans(c), acc, input_precision=DOT_PREC)
        return acc

    @triton.jit
    def _fwd_kernel(
        E, C, T, LSE_P, TGT_P,
        N, D, n_valid, blocks_per_split, stride_e, stride_c, softcap,
        HAS_SOFTCAP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        num_m = tl.cdiv(N, BLOCK_M)
        pid_m = pid % num_m
        pid_s = pid // num_m
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < N
        tgt = tl.load(T + rows, mask=row_ok, other=-1)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        s_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        t_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        n_vb = tl.cdiv(n_valid, BLOCK_V)
        vb_lo = pid_s * blocks_per_split
        vb_hi = tl.minimum(vb_lo + blocks_per_split, n_vb)
        for vb in range(vb_lo, vb_hi):
            cols = vb * BLOCK_V + tl.arange(0, BLOCK_V)
            col_ok = cols < n_valid
            acc = _tile_logits(
                E, C, rows, cols, row_ok, col_ok, D, stride_e, stride_c, BLOCK_M, BLOCK_V, BLOCK_D, EVEN_D, DOT_PREC
            )
            if HAS_SOFTCAP:
                acc = softcap * (2.0 * tl.sigmoid(acc * (2.0 / softcap)) - 1.0)
            acc = tl.where(col_ok[None, :], acc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(acc, axis=1))
            s_i = s_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(acc - m_new[:, None]), axis=1)
            m_i = m_new
            t_i += tl.sum(tl.where(cols[None, :] == tgt[:, None], acc, 0.0), axis=1)
        tl.store(LSE_P + pid_s * N + rows, m_i + tl.log(s_i), mask=row_ok)
        tl.store(TGT_P + pid_s * N + rows, t_i, mask=row_ok)

    @triton.jit
    def _bwd_kernel(
        E, C, T, LSE, GS, GT, PERM, DE, DC, DE_LOCK, DC_LOCK,
        N, D, n_valid, stride_e, stride_c, stride_de, stride_dc, softcap, eps,
        HAS_SOFTCAP: tl.constexpr, FILTER: tl.constexpr, HAS_PERM: tl.constexpr, GROUP_M: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
        MM_BLOCK_D: tl.constexpr, MM_EVEN_D: tl.constexpr, ORDERED: tl.constexpr, DOT_PREC: tl.constexpr,
    ):  # fmt: skip
        # grouped order: GROUP_M row blocks share each vocabulary tile back to back (C read from HBM once per
        # group, E of the group stays in L2), while a tile's dC locks see at most GROUP_M contenders at a time
        pid = tl.program_id(0)
        num_m = tl.cdiv(N, BLOCK_M)
        per_group = GROUP_M * tl.cdiv(n_valid, BLOCK_V)
        first_m = (pid // per_group) * GROUP_M
        group_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_m
        pid_v = (pid % per_group) // group_m
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < N
        pos = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        col_ok = pos < n_valid
        if HAS_PERM:
            cols = tl.load(PERM + pos, mask=col_ok, other=0)
        else:
            cols = pos
        acc = _tile_logits(
            E, C, rows, cols, row_ok, col_ok, D, stride_e, stride_c, BLOCK_M, BLOCK_V, BLOCK_D, EVEN_D, DOT_PREC
        )
        if HAS_SOFTCAP:
            th = 2.0 * tl.sigmoid(acc * (2.0 / softcap)) - 1.0
            acc = softcap * th
        lse = tl.load(LSE + rows, mask=row_ok, other=float("inf"))
        p = tl.exp(acc - lse[:, None])
        p = tl.where(row_ok[:, None] & col_ok[None, :], p, 0.0)
        keep = True
        if FILTER:
            keep = tl.max(tl.max(p, axis=1), axis=0) >= eps
        if keep:
            gs = tl.load(GS + rows, mask=row_ok, other=0.0)
            g = gs[:, None] * p
            if not FILTER:
                # exact mode runs every tile: the one-hot part goes in here, so p − 1 at the target cancels in
                # fp32 before g is rounded (added afterwards it cancels against the rounded sum: 0.87 vs 0.71
                # dE error on the Gemma shape, H200)
                tgt = tl.load(T + rows, mask=row_ok, other=-1)
                gt = tl.load(GT + rows, mask=row_ok, other=0.0)
                g = g - tl.where((cols[None, :] == tgt[:, None]) & col_ok[None, :], gt[:, None], 0.0)
            if HAS_SOFTCAP:
                g = g * (1.0 - th * th)
            g = g.to(E.dtype.element_ty)
            n_dc = tl.cdiv(D, MM_BLOCK_D)
            # ORDERED (exact mode): dE of row block m takes tiles in vocabulary order, dC of tile v in row order
            _locked_mm_add(g, C, cols, col_ok, DE, rows, row_ok, stride_c, stride_de, DE_LOCK + pid_m * n_dc, D,
                           pid_v, MM_BLOCK_D, MM_EVEN_D, ORDERED, DOT_PREC)  # fmt: skip
            _locked_mm_add(tl.trans(g), E, rows, row_ok, DC, cols, col_ok, stride_e, stride_dc, DC_LOCK + pid_v * n_dc,
                           D, pid_m, MM_BLOCK_D, MM_EVEN_D, ORDERED, DOT_PREC)  # fmt: skip

    @triton.jit
    def _locked_mm_add(
        a, B, b_rows, b_ok, OUT, o_rows, o_ok, stride_b, stride_o, LOCKS, D, turn,
        BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, ORDERED: tl.constexpr, DOT_PREC: tl.constexpr,
    ):  # fmt: skip
        """OUT[o_rows] += a @ B[b_rows], one D chunk at a time, each chunk under its own spin lock.

        Vectorised read-modify-write under a lock instead of per-element atomics: one atomic pair per
        chunk, and a single rounding per add into a low-precision buffer. ``ORDERED`` makes the lock a
        ticket: this program adds when the chunk's counter equals ``turn``, then advances it, so the adds
        land in a fixed order and the result is bitwise reproducible. Every writer of the block must run
        (no skipped tiles), and each waits only on lower program ids, which are dispatched first.
        """
        offs_d = tl.arange(0, BLOCK_D)
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + offs_d
            if EVEN_D:
                m_b = b_ok[:, None]
                m_o = o_ok[:, None]
            else:
                m_b = b_ok[:, None] & (dd < D)[None, :]
                m_o = o_ok[:, None] & (dd < D)[None, :]
            b = tl.load(B + b_rows[:, None] * stride_b + dd[None, :], mask=m_b, other=0.0)
            part = tl.dot(a, b, input_precision=DOT_PREC)
            lock = LOCKS + d0 // BLOCK_D
            if ORDERED:
                while tl.atomic_cas(lock, turn, turn) != turn:
                    pass
            else:
                while tl.atomic_cas(lock, 0, 1) == 1:
                    pass
            ptrs = OUT + o_rows[:, None] * stride_o + dd[None, :]
            cur = tl.load(ptrs, mask=m_o, other=0.0)
            tl.store(ptrs, (cur.to(tl.float32) + part).to(OUT.dtype.element_ty), mask=m_o)
            # every thread's stores must be issued before one thread's release hands the chunk on
            tl.debug_barrier()
            if ORDERED:
                tl.atomic_xchg(lock, turn + 1)
            else:
                tl.atomic_xchg(lock, 0)


def _pick(cfg: KernelConfig | None, default: KernelConfig, t: Tensor) -> KernelConfig:
    if cfg is not None:
        return cfg
    if not t.is_cuda:
        return _SMALL
    if t.element_size() > 2:
        return _FP32["fwd" if default is FWD_CONFIG else "bwd"]
    return default


def _dot_prec(t: Tensor) -> str:
    return "ieee" if t.dtype == torch.float32 else "tf32"


def _check(h: Tensor, w: Tensor) -> None:
    if h.dtype != w.dtype or h.shape[-1] != w.shape[-1]:
        raise ValueError(f"cce: hidden {tuple(h.shape)} {h.dtype} and weight {tuple(w.shape)} {w.dtype} must agree")


def triton_shard_forward(
    h: Tensor,
    w: Tensor,
    tgt: Tensor,
    n_valid: int,
    softcap: float | None = None,
    cfg: KernelConfig | None = None,
    splits: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Triton version of ``reference.torch_shard_forward`` (same contract)."""
    _check(h, w)
    cfg = _pick(cfg, FWD_CONFIG, h)
    h, w = h.contiguous(), w.contiguous()
    n, d = h.shape
    dev = h.device
    if n == 0 or n_valid == 0:
        return torch.full((n,), float("-inf"), device=dev), torch.zeros(n, device=dev)
    num_m = triton.cdiv(n, cfg.block_m)
    n_vb = triton.cdiv(n_valid, cfg.block_v)
    if splits is None:
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if h.is_cuda else 4
        splits = max(1, min(n_vb, triton.cdiv(8 * sms, num_m)))  # 8 programs per SM: measured best on H200
    per = triton.cdiv(n_vb, splits)
    splits = triton.cdiv(n_vb, per)
    lse_p = torch.empty(splits, n, dtype=torch.float32, device=dev)
    tgt_p = torch.empty(splits, n, dtype=torch.float32, device=dev)
    _fwd_kernel[(num_m * splits,)](
        h, w, tgt.to(torch.int32).contiguous(), lse_p, tgt_p,
        n, d, n_valid, per, h.stride(0), w.stride(0), float(softcap or 1.0),
        HAS_SOFTCAP=softcap is not None,
        BLOCK_M=cfg.block_m, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d, EVEN_D=d % cfg.block_d == 0,
        DOT_PREC=_dot_prec(h), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    lse = torch.logsumexp(lse_p, dim=0) if splits > 1 else lse_p[0]
    return lse, tgt_p.sum(0)


def triton_shard_backward(
    h: Tensor,
    w: Tensor,
    tgt: Tensor,
    lse: Tensor,
    gs: Tensor,
    gt: Tensor,
    n_valid: int,
    softcap: float | None = None,
    filter_eps: float | None = None,
    perm: Tensor | None = None,
    accum_fp32: bool = False,
    cfg: KernelConfig | None = None,
) -> tuple[Tensor, Tensor]:
    """Triton version of ``reference.torch_shard_backward``; filtering is per (row block, vocab block) tile.

    Gradients are added under per-chunk spin locks into buffers of the input dtype. ``accum_fp32`` gives dE
    an fp32 scratch ([n, D]): each dE row takes one add per kept vocabulary tile (hundreds at a 256K
    vocabulary), so bf16 rounding dominates its error; dC rows take one add per row block and stay in the
    input dtype (docs/benchmarks/cce.md, gradient accuracy).
    """
    _check(h, w)
    cfg = _pick(cfg, BWD_CONFIG, h)
    h, w = h.contiguous(), w.contiguous()
    n, d = h.shape
    d_e = torch.zeros(n, d, dtype=torch.float32 if accum_fp32 else h.dtype, device=h.device)
    d_c = torch.zeros(w.shape[0], d, dtype=w.dtype, device=h.device)
    if n and n_valid:
        _launch_bwd(h, w, tgt, lse, gs, gt, perm, d_e, d_c, n_valid, softcap, filter_eps, cfg)
    return d_e.to(h.dtype), d_c.to(w.dtype)


def _launch_bwd(h, w, tgt, lse, gs, gt, perm, d_e, d_c, n_valid, softcap, filter_eps, cfg) -> None:
    n, d = h.shape
    num_m = triton.cdiv(n, cfg.block_m)
    n_vb = triton.cdiv(n_valid, cfg.block_v)
    perm_t = perm.to(torch.int32).contiguous() if perm is not None else lse
    mm_d = cfg.mm_block_d or cfg.block_d
    n_dc = triton.cdiv(d, mm_d)
    locks = torch.zeros(num_m * n_dc + n_vb * n_dc, dtype=torch.int32, device=h.device).split(
        [num_m * n_dc, n_vb * n_dc]
    )
    _bwd_kernel[(num_m * n_vb,)](
        h, w, tgt.to(torch.int32).contiguous(), lse.float().contiguous(), gs.float().contiguous(),
        gt.float().contiguous(), perm_t, d_e, d_c, locks[0], locks[1],
        n, d, n_valid, h.stride(0), w.stride(0), d_e.stride(0), d_c.stride(0),
        float(softcap or 1.0), float(filter_eps or 0.0),
        HAS_SOFTCAP=softcap is not None, FILTER=filter_eps is not None, HAS_PERM=perm is not None, GROUP_M=cfg.group_m,
        BLOCK_M=cfg.block_m, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d, EVEN_D=d % cfg.block_d == 0,
        MM_BLOCK_D=mm_d, MM_EVEN_D=d % mm_d == 0, ORDERED=filter_eps is None,
        DOT_PREC=_dot_prec(h), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if filter_eps is not None:  # exact mode added the one-hot part inside the tiles
        add_target_term(h, w, tgt, gt, softcap, d_e, d_c)


_TARGET_CHUNK_ELEMS = 1 << 20  # [rows, D] temporaries of the target pass: 2 MB each in bf16


def add_target_term(
    h: Tensor, w: Tensor, tgt: Tensor, gt: Tensor, softcap: float | None, d_e: Tensor, d_c: Tensor
) -> None:
    """dE[r] −= c_r·W[t_r] and dW[t_r] −= c_r·h[r] for rows whose target lies in this slice (c_r = gt_r, times
    the softcap derivative at the target logit).

    The one-hot part of the logit gradient touches one column per row, so it runs row-owned and chunked
    instead of forcing every tile that holds a target through the tile kernel's locked adds (filtered mode only;
    exact mode forms it inside the tiles).
    """
    n, d = h.shape
    step = max(1, _TARGET_CHUNK_ELEMS // max(d, 1))
    for s in range(0, n, step):
        e = min(s + step, n)
        t = tgt[s:e]
        tc = t.clamp_min(0).long()
        coef = torch.where(t >= 0, gt[s:e].float(), 0.0)
        wt = w.index_select(0, tc)
        if softcap is not None:
            th = torch.tanh(torch.linalg.vecdot(h[s:e].float(), wt.float()) / softcap)
            coef = coef * (1 - th * th)
        d_e[s:e].addcmul_(coef.to(d_e.dtype).unsqueeze(1), wt, value=-1)
        d_c.index_add_(0, tc, h[s:e] * coef.to(d_c.dtype).unsqueeze(1), alpha=-1)


def shard_forward(
    h: Tensor,
    w: Tensor,
    tgt: Tensor,
    n_valid: int,
    softcap: float | None = None,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """Loss pieces of one vocabulary slice: (lse partial [n], target-logit partial [n]).

    ``tgt`` is the target's column within this slice, -1 where it lies in another slice. Merge the
    partials of all slices with logsumexp / sum, then call ``shard_backward`` with the merged lse.
    """
    if (backend or backend_for(h)) == "triton":
        return triton_shard_forward(h, w, tgt, n_valid, softcap)
    return torch_shard_forward(h, w, tgt, n_valid, softcap)


def vocab_order(h: Tensor, w: Tensor, n_valid: int) -> Tensor | None:
    """Walk order for the filtered backward: this slice's columns by descending mean logit over the rows of h.

    Columns that are small for most rows then share tiles, so whole tiles fall below the filter threshold.
    The mean logit is W·mean(h) (one GEMV, no pass over the logits); with a softcap it ranks the capped
    logits the same way up to the cap's curvature, which is all a sort key needs.
    """
    if h.shape[0] == 0 or n_valid == 0:
        return None
    mean = h.mean(0, dtype=torch.float32).to(w.dtype)
    return torch.argsort(w[:n_valid] @ mean, descending=True, stable=True)


def shard_backward(
    h: Tensor,
    w: Tensor,
    tgt: Tensor,
    lse: Tensor,
    gs: Tensor,
    gt: Tensor,
    n_valid: int,
    softcap: float | None = None,
    filter_eps: float | None = None,
    perm: Tensor | None = None,
    accum_fp32: bool = False,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """(dE, dC) of this slice for dlogits = gs·softmax(logits − merged lse) − gt·onehot(tgt)."""
    if (backend or backend_for(h)) == "triton":
        return triton_shard_backward(h, w, tgt, lse, gs, gt, n_valid, softcap, filter_eps, perm, accum_fp32)
    return torch_shard_backward(h, w, tgt, lse, gs, gt, n_valid, softcap, filter_eps, perm)


@dataclass(frozen=True)
class CCEOptions:
    """What the autograd Function needs from LossConfig plus the shard geometry."""

    n_valid: int
    vocab_start: int
    softcap: float | None = None
    z_loss: float = 0.0
    filter_eps: float | None = 2.0**-12
    sort_vocab: bool = False
    accum_fp32: bool = False
    ignore_index: int = -100
    sequence_parallel: bool = False
    backend: str | None = None


def _rows_or_all(h: Tensor, rows: Tensor | None) -> Tensor:
    return h if rows is None else h.index_select(0, rows)


def rows_to_all(x: Tensor, rows: Tensor | None, n: int) -> Tensor:
    """Inverse of selecting ``rows``: ``x`` scattered into n rows of zeros (``x`` itself when rows is None)."""
    return x if rows is None else x.new_zeros(n, *x.shape[1:]).index_copy_(0, rows, x)


def valid_rows(targets: Tensor, ignore_index: int) -> Tensor | None:
    """Indices of the rows whose target is not ``ignore_index``; None when all are (the common case, no copy).

    Callers drop the others before any kernel or collective (the paper's Appendix A)."""
    valid = targets != ignore_index
    return None if bool(valid.all()) else valid.nonzero().squeeze(1)


def local_targets(targets: Tensor, start: int, n_valid: int) -> Tensor:
    """Each target's column in the vocabulary slice [start, start + n_valid), -1 where it lies elsewhere."""
    t = targets - start
    return torch.where((t >= 0) & (t < n_valid), t, torch.full_like(t, -1))


class VocabParallelCCE(torch.autograd.Function):
    """Per-token loss lse − target logit + z·lse² over a TP-sharded vocabulary, never materialising logits.

    Ignored rows are compacted out before any kernel runs; the backward runs on ``keep_idx`` ∩ valid rows
    only, and only those rows travel in the dE collective.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, keep_idx, group, opt: CCEOptions):
        from megasparse.parallel import vocab

        keep = keep_idx
        keep_idx = keep_idx if isinstance(keep_idx, Tensor) else None
        h_shape = hidden.shape  # [s, b, h] from the model, [n, h] from direct callers
        hidden = hidden.reshape(-1, h_shape[-1])

        h_full = vocab.gather_rows(hidden, group, opt.sequence_parallel)
        n = targets.numel()
        valid = targets != opt.ignore_index
        vrows = valid_rows(targets, opt.ignore_index)
        h_v = _rows_or_all(h_full, vrows)
        t_v = local_targets(_rows_or_all(targets, vrows), opt.vocab_start, opt.n_valid)
        lse_l, tgt_l = shard_forward(h_v, weight, t_v, opt.n_valid, opt.softcap, opt.backend)
        lse, tgt = vocab.merge_shard_stats(lse_l.float(), tgt_l.float(), group)
        loss_v = lse - tgt
        if opt.z_loss:
            loss_v = loss_v + opt.z_loss * lse * lse
        loss, lse_full = rows_to_all(loss_v, vrows, n), rows_to_all(lse, vrows, n)
        ctx.save_for_backward(h_full, weight, targets, lse_full, keep_idx, valid)
        ctx.group, ctx.opt, ctx.n_local, ctx.h_shape = group, opt, hidden.shape[0], h_shape
        # ``keep_idx`` may instead be a holder whose ``meta`` the trainer fills after selection.
        ctx.keep = keep

        return loss

    @staticmethod
    def backward(ctx, grad: Tensor):
        from megasparse.parallel import vocab

        h_full, weight, targets, lse, keep_idx, valid = ctx.saved_tensors
        opt: CCEOptions = ctx.opt
        n = targets.numel()
        meta = getattr(ctx.keep, "meta", None)
        if meta is not None:  # trainer's Collider path: kept rows chosen after the forward, compact dE out
            keep_idx = meta.idx
        if keep_idx is not None:
            mask = torch.zeros(n, dtype=torch.bool, device=targets.device)
            mask[keep_idx] = True
            mask &= valid
            rows = mask.nonzero().squeeze(1)
        else:
            rows = valid_rows(targets, opt.ignore_index)
        g = _rows_or_all(grad.float(), rows)
        lse_r = _rows_or_all(lse, rows)
        gs = g * (1 + 2 * opt.z_loss * lse_r) if opt.z_loss else g
        t_r = local_targets(_rows_or_all(targets, rows), opt.vocab_start, opt.n_valid)
        h_r = _rows_or_all(h_full, rows)
        perm = vocab_order(h_r, weight, opt.n_valid) if opt.sort_vocab and opt.filter_eps is not None else None
        d_e, d_c = shard_backward(
            h_r, weight, t_r, lse_r, gs, g, opt.n_valid, opt.softcap, opt.filter_eps, perm, opt.accum_fp32, opt.backend
        )
        if meta is not None:
            return (
                vocab.compact_kept_grad(d_e, rows, meta, ctx.group, opt.sequence_parallel, ctx.h_shape),
                d_c,
                None,
                None,
                None,
                None,
            )
        with comm.phase("backward"):
            d_h = vocab.reduce_kept_grad(d_e, rows, n, ctx.group, opt.sequence_parallel)
        return d_h.view(ctx.h_shape), d_c, None, None, None, None
