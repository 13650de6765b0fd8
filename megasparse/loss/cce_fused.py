"""CCE's logit passes as Triton GEMMs with the softmax maths in their epilogue (Hopper; used by ``cce_gemm.py``).

The GEMM backend's logit passes computed S = H·W_cᵀ in cuBLAS, wrote it in fp32 and read it back in a Triton kernel:
on the Llama-3-8B shape that round trip (8 GB) made the forward 14.8 ms against 11.7 ms for the bare GEMM, and the
backward's S pass was the slowest of its three. Here each [BLOCK_M, BLOCK_V] logit tile stays in registers:

* ``_lse_kernel`` (forward): the tile's log-sum-exp per row goes to a [tiles, rows] fp32 partial buffer (folded
  by a logsumexp afterwards: no lock, deterministic), and the tile holding a row's target stores its logit;
* ``_grad_kernel`` (backward): P = gs·softmax(S − lse) − gt·onehot (× softcap′) is stored in the input dtype into
  the chunk's P buffer, which the backend's cuBLAS GEMMs then read for dC and dE.

Operands come through TMA tensor descriptors (``TensorDescriptor``), which is why this path is for sm_90+ in bf16
or fp16 (``usable``); elsewhere the backend keeps its cuBLAS logit pass. The fp32 sums are the same wgmma sums
cuBLAS forms, so P matches the cuBLAS path's P. Measurements in decision 0204.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megasparse.loss.cce_kernels import tl, triton

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - triton too old for host-side descriptors, or none at all
    TensorDescriptor = None


@dataclass(frozen=True)
class TileConfig:
    """Tiling of one fused logit pass (decision 0204 has the sweep)."""

    block_m: int = 128
    block_v: int = 256
    block_d: int = 64
    group: int = 16
    """Row blocks that take each vocabulary tile back to back: the classifier tile is read from HBM once per group."""
    num_warps: int = 8
    num_stages: int = 3


FWD = TileConfig()
BWD = TileConfig()
ENABLED = True
"""False: the GEMM backend keeps its cuBLAS logit pass everywhere (benchmarks compare the two)."""


def usable(h: Tensor, w: Tensor) -> bool:
    """Whether the fused passes run here: a Hopper-or-newer GPU, 16-bit operands, rows TMA can stride."""
    return (
        ENABLED
        and TensorDescriptor is not None
        and h.is_cuda
        and h.dtype in (torch.bfloat16, torch.float16)
        and w.dtype == h.dtype
        and h.shape[1] % 8 == 0
        and torch.cuda.get_device_capability(h.device)[0] >= 9
    )


if triton is not None:

    @triton.jit
    def _tile_of(pid, num_m, num_v, GROUP: tl.constexpr):
        width = GROUP * num_v
        first_m = (pid // width) * GROUP
        size = tl.minimum(num_m - first_m, GROUP)
        return first_m + (pid % width) % size, (pid % width) // size

    @triton.jit
    def _logits(e_desc, c_desc, m0, v0, D, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
        acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            acc = tl.dot(e_desc.load([m0, d0]), c_desc.load([v0, d0]).T, acc)
        return acc

    @triton.jit
    def _lse_kernel(
        e_desc, c_desc, T, PART, TGT_LOGIT, n, n_cols, v_base, D, softcap,
        HAS_SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
        GROUP: tl.constexpr,
    ):  # fmt: skip
        pid_m, pid_v = _tile_of(tl.program_id(0), tl.cdiv(n, BLOCK_M), tl.cdiv(n_cols, BLOCK_V), GROUP)
        m0 = pid_m * BLOCK_M
        c0 = pid_v * BLOCK_V
        x = _logits(e_desc, c_desc, m0, v_base + c0, D, BLOCK_M, BLOCK_V, BLOCK_D)
        if HAS_SOFTCAP:
            x = softcap * (2.0 * tl.sigmoid(x * (2.0 / softcap)) - 1.0)
        rows = m0 + tl.arange(0, BLOCK_M)
        cols = c0 + tl.arange(0, BLOCK_V)
        row_ok = rows < n
        x = tl.where((cols < n_cols)[None, :], x, float("-inf"))  # every tile holds at least one real column
        m = tl.max(x, axis=1)
        tl.store(PART + pid_v.to(tl.int64) * n + rows, m + tl.log(tl.sum(tl.exp(x - m[:, None]), axis=1)), mask=row_ok)
        t = tl.load(T + rows, mask=row_ok, other=-1) - v_base
        inside = row_ok & (t >= c0) & (t < c0 + BLOCK_V) & (t < n_cols)
        xt = tl.sum(tl.where(cols[None, :] == t[:, None], x, 0.0), axis=1)
        tl.store(TGT_LOGIT + rows, xt, mask=inside)  # one tile per row holds its target: a plain store

    @triton.jit
    def _grad_kernel(
        e_desc, c_desc, P, LSE, GS, GT, T, n, c, v0, stride_p, D, softcap,
        HAS_SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
        GROUP: tl.constexpr,
    ):  # fmt: skip
        pid_m, pid_v = _tile_of(tl.program_id(0), tl.cdiv(n, BLOCK_M), tl.cdiv(c, BLOCK_V), GROUP)
        m0 = pid_m * BLOCK_M
        c0 = pid_v * BLOCK_V
        x = _logits(e_desc, c_desc, m0, v0 + c0, D, BLOCK_M, BLOCK_V, BLOCK_D)
        rows = m0 + tl.arange(0, BLOCK_M)
        cols = c0 + tl.arange(0, BLOCK_V)
        row_ok = rows < n
        lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
        gs = tl.load(GS + rows, mask=row_ok, other=0.0)
        gt = tl.load(GT + rows, mask=row_ok, other=0.0)
        t = tl.load(T + rows, mask=row_ok, other=-1) - v0
        if HAS_SOFTCAP:
            th = 2.0 * tl.sigmoid(x * (2.0 / softcap)) - 1.0
            x = softcap * th
        p = gs[:, None] * tl.exp(x - lse[:, None])
        p = p - tl.where(cols[None, :] == t[:, None], gt[:, None], 0.0)
        if HAS_SOFTCAP:
            p = p * (1.0 - th * th)
        ok = row_ok[:, None] & (cols < c)[None, :]
        tl.store(P + rows.to(tl.int64)[:, None] * stride_p + cols[None, :], p.to(P.dtype.element_ty), mask=ok)


def _descs(h: Tensor, w: Tensor, cfg: TileConfig):
    return (
        TensorDescriptor.from_tensor(h, [cfg.block_m, cfg.block_d]),
        TensorDescriptor.from_tensor(w, [cfg.block_v, cfg.block_d]),
    )


def _grid(n: int, c: int, cfg: TileConfig) -> tuple[int]:
    return (triton.cdiv(n, cfg.block_m) * triton.cdiv(c, cfg.block_v),)


def lse_pass(
    h: Tensor,
    w: Tensor,
    t32: Tensor,
    n_valid: int,
    softcap: float | None,
    budget: int,
    cfg: TileConfig | None = None,
) -> tuple[Tensor, Tensor]:
    """(lse [n] fp32, target logit [n] fp32) of columns [0, n_valid) of ``w``; the tile partials stay within
    ``budget`` bytes (one launch for the whole slice at 8192 rows and 48 MB)."""
    n, d = h.shape
    cfg = cfg or FWD
    e_desc, c_desc = _descs(h, w, cfg)
    tiles = max(1, budget // (4 * n))
    cols = tiles * cfg.block_v
    part = torch.empty(min(tiles, triton.cdiv(n_valid, cfg.block_v)), n, dtype=torch.float32, device=h.device)
    tlogit = torch.zeros(n, dtype=torch.float32, device=h.device)
    lse = None
    for v0 in range(0, n_valid, cols):
        c = min(cols, n_valid - v0)
        _lse_kernel[_grid(n, c, cfg)](
            e_desc, c_desc, t32, part, tlogit, n, c, v0, d, float(softcap or 1.0),
            HAS_SOFTCAP=softcap is not None, BLOCK_M=cfg.block_m, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d,
            GROUP=cfg.group, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        chunk = torch.logsumexp(part[: triton.cdiv(c, cfg.block_v)], 0)
        lse = chunk if lse is None else torch.logaddexp(lse, chunk, out=lse)
    return lse, tlogit


def grad_pass(
    h: Tensor,
    w: Tensor,
    t32: Tensor,
    lse: Tensor,
    gs: Tensor,
    gt: Tensor,
    v0: int,
    p: Tensor,
    softcap: float | None,
    cfg: TileConfig | None = None,
    descs: tuple | None = None,
) -> None:
    """P of columns [v0, v0 + p.shape[1]) into ``p`` ([n, c], the input dtype); ``descs`` reuses the descriptors."""
    n, d = h.shape
    cfg = cfg or BWD
    c = p.shape[1]
    e_desc, c_desc = descs or _descs(h, w, cfg)
    _grad_kernel[_grid(n, c, cfg)](
        e_desc, c_desc, p, lse, gs, gt, t32, n, c, v0, p.stride(0), d, float(softcap or 1.0),
        HAS_SOFTCAP=softcap is not None, BLOCK_M=cfg.block_m, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d,
        GROUP=cfg.group, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def descriptors(h: Tensor, w: Tensor) -> tuple:
    """The (h, w) descriptors of the backward's chunks, built once per call."""
    return _descs(h, w, BWD)
