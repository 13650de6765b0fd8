"""Cut Cross-Entropy Triton kernels on one vocabulary shard (launched by ``cce_launch.py``).

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
one-hot part (−gt at each row's target) is added by ``rows.add_target_term``, a row-owned pass: inside the
tile kernel it would force every tile holding a target through the locked adds.
"""

from __future__ import annotations

from dataclasses import dataclass

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU images without triton use the torch path
    triton = None
    tl = None


@dataclass(frozen=True)
class KernelConfig:
    """Tile shape and pipelining of one kernel (chosen on H100/H200, see docs/benchmarks/cce.md); the tile kernels'
    and the GEMM backend's fused logit passes' (``cce_fused.py``)."""

    block_m: int = 128
    block_v: int = 128
    block_d: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8
    """Row blocks that visit each vocabulary tile back to back (the classifier tile is read from HBM once a group;
    the tile kernels' forward does not group)."""
    mm_block_d: int = 0
    """Tile kernels' backward only: D chunk of the dE/dC read-modify-writes (0: ``block_d``); each has its own lock."""
    flatten: bool = False
    """Fused logit passes only (persistent programs): pipeline the next tile's loads across the tile loop."""
    warp_specialize: bool = False
    """Fused logit passes only: Triton's warp specialisation of the tile loop (loads in their own warps)."""


if triton is not None:

    @triton.jit
    def _capped(x, softcap, HAS_SOFTCAP: tl.constexpr):
        """Gemma-2's logit soft-cap, softcap·tanh(x / softcap) (through a sigmoid: exact in fp32)."""
        if HAS_SOFTCAP:
            x = softcap * (2.0 * tl.sigmoid(x * (2.0 / softcap)) - 1.0)
        return x

    @triton.jit
    def _grouped_tile(pid, num_m, num_v, GROUP_M: tl.constexpr):
        """(row block, vocabulary block) of program ``pid`` when GROUP_M row blocks take each vocabulary block back
        to back: the classifier tile is read from HBM once per group and the group's rows stay in L2."""
        per_group = GROUP_M * num_v
        first_m = (pid // per_group) * GROUP_M
        group_m = tl.minimum(num_m - first_m, GROUP_M)
        return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m

    @triton.jit
    def _p_tile(x, cols, lse, gs, gt, t, softcap, HAS_SOFTCAP: tl.constexpr):
        """dlogits of a tile of raw logits ``x`` (fp32): gs·softmax(capped x − lse) − gt·onehot(t), times the soft-cap
        derivative; ``cols`` and ``t`` (each row's target) in the same column frame."""
        if HAS_SOFTCAP:
            th = 2.0 * tl.sigmoid(x * (2.0 / softcap)) - 1.0
            x = softcap * th
        p = gs[:, None] * tl.exp(x - lse[:, None])
        p = p - tl.where(cols[None, :] == t[:, None], gt[:, None], 0.0)
        if HAS_SOFTCAP:
            p = p * (1.0 - th * th)
        return p

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
        # grouped order: besides the L2 reuse, a tile's dC locks see at most GROUP_M contenders at a time
        pid_m, pid_v = _grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_M), tl.cdiv(n_valid, BLOCK_V), GROUP_M)
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
