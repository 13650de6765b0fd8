"""CCE's logit passes as Triton GEMMs with the softmax maths in their epilogue (Hopper; used by ``cce_gemm.py``).

The GEMM backend's logit passes computed S = H·W_cᵀ in cuBLAS, wrote it in fp32 and read it back in a Triton kernel:
on the Llama-3-8B shape that round trip (8 GB) made the forward 14.8 ms against 11.7 ms for the bare GEMM, and the
backward's S pass was the slowest of its three. Here each [BLOCK_M, BLOCK_V] logit tile stays in registers:

* ``_lse_kernel`` (forward): the tile's log-sum-exp per row goes to a [tiles, rows] fp32 partial buffer (folded
  by a logsumexp afterwards: no lock, deterministic), and the tile holding a row's target stores its logit;
* ``_grad_kernel`` (backward): P = gs·softmax(S − lse) − gt·onehot (× softcap′) is stored in the input dtype into
  the chunk's P buffer, which the backend's cuBLAS GEMMs then read for dC and dE.

Both kernels are persistent: one program per SM walks the tiles (grouped as before) instead of one program per tile.
The forward also flattens its loop nest and warp-specialises it (``KernelConfig.flatten``, ``.warp_specialize``), so
Triton can load the next tile's operands during this tile's epilogue. On H200s that took the Llama-3-8B forward
from 12.2 to 11.4-11.7 ms and the P pass from 13.9 to 12.6-12.8 ms (decision 0204's second addendum).

Operands come through TMA tensor descriptors (``TensorDescriptor``), which is why this path is for sm_90+ in bf16
or fp16 (``usable``); elsewhere the backend keeps its cuBLAS logit pass. P equals the cuBLAS pass's to bf16 rounding
(the dC error against fp64 is the same to three digits). Measurements in decision 0204.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megasparse.loss.cce_kernels import KernelConfig, _capped, _grouped_tile, _p_tile, tl, triton

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - triton too old for host-side descriptors, or none at all
    TensorDescriptor = None

FWD = KernelConfig(
    block_m=128, block_v=256, block_d=64, num_warps=8, num_stages=3, group_m=16, flatten=True, warp_specialize=True
)
"""Tiling of the forward pass (decision 0204 has the sweeps; persistent, flattened and warp-specialised since its
second addendum)."""
BWD = KernelConfig(block_m=128, block_v=256, block_d=64, num_warps=8, num_stages=3, group_m=16)
"""Tiling of the backward's P pass: the forward's tiles, persistent, without flattening or warp specialisation (with
them the P pass took 12.5-13.4 ms over four calls on H200s, without them 12.6-12.8; decision 0204's second
addendum)."""
ENABLED = True
"""False: the GEMM backend keeps its cuBLAS logit pass everywhere (benchmarks compare the two)."""


def tma_ok(t: Tensor) -> bool:
    """Rows a TMA descriptor can address: unit inner stride, 16-byte aligned base and row stride."""
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def usable(h: Tensor, w: Tensor) -> bool:
    """Whether the fused passes run here: a Hopper-or-newer GPU, 16-bit operands (fp32 would run as TF32), rows TMA
    can address."""
    return (
        ENABLED
        and TensorDescriptor is not None
        and h.is_cuda
        and h.dtype in (torch.bfloat16, torch.float16)
        and w.dtype == h.dtype
        and torch.cuda.get_device_capability(h.device)[0] >= 9
        and tma_ok(h)
        and tma_ok(w)
    )


if triton is not None:

    @triton.jit
    def _logit_tile(
        e_desc, c_desc, tile, num_m, num_v, v_base, D,
        BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
    ):  # fmt: skip
        """(S tile in fp32, its first row, its first column relative to ``v_base``, its vocabulary block) of ``tile``
        in the grouped order: the whole of D through TMA-fed dots."""
        pid_m, pid_v = _grouped_tile(tile, num_m, num_v, GROUP)
        m0 = pid_m * BLOCK_M
        c0 = pid_v * BLOCK_V
        acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            acc = tl.dot(e_desc.load([m0, d0]), c_desc.load([v_base + c0, d0]).T, acc)
        return acc, m0, c0, pid_v

    @triton.jit
    def _lse_kernel(
        e_desc, c_desc, T, PART, TGT_LOGIT, n, n_cols, v_base, D, n_progs, softcap,
        HAS_SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
        GROUP: tl.constexpr, FLATTEN: tl.constexpr, WS: tl.constexpr,
    ):  # fmt: skip
        num_m = tl.cdiv(n, BLOCK_M)
        num_v = tl.cdiv(n_cols, BLOCK_V)
        for tile in tl.range(tl.program_id(0), num_m * num_v, n_progs, flatten=FLATTEN, warp_specialize=WS):
            acc, m0, c0, pid_v = _logit_tile(
                e_desc, c_desc, tile, num_m, num_v, v_base, D, BLOCK_M, BLOCK_V, BLOCK_D, GROUP
            )
            x = _capped(acc, softcap, HAS_SOFTCAP)
            rows = m0 + tl.arange(0, BLOCK_M)
            cols = c0 + tl.arange(0, BLOCK_V)
            row_ok = rows < n
            x = tl.where((cols < n_cols)[None, :], x, float("-inf"))  # every tile holds at least one real column
            m = tl.max(x, axis=1)
            lse = m + tl.log(tl.sum(tl.exp(x - m[:, None]), axis=1))
            tl.store(PART + pid_v.to(tl.int64) * n + rows, lse, mask=row_ok)
            t = tl.load(T + rows, mask=row_ok, other=-1) - v_base
            inside = row_ok & (t >= c0) & (t < c0 + BLOCK_V) & (t < n_cols)
            xt = tl.sum(tl.where(cols[None, :] == t[:, None], x, 0.0), axis=1)
            tl.store(TGT_LOGIT + rows, xt, mask=inside)  # one tile per row holds its target: a plain store

    @triton.jit
    def _grad_kernel(
        e_desc, c_desc, P, LSE, GS, GT, T, n, c, v0, stride_p, D, n_progs, softcap,
        HAS_SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
        GROUP: tl.constexpr, FLATTEN: tl.constexpr, WS: tl.constexpr,
    ):  # fmt: skip
        num_m = tl.cdiv(n, BLOCK_M)
        num_v = tl.cdiv(c, BLOCK_V)
        for tile in tl.range(tl.program_id(0), num_m * num_v, n_progs, flatten=FLATTEN, warp_specialize=WS):
            acc, m0, c0, _ = _logit_tile(e_desc, c_desc, tile, num_m, num_v, v0, D, BLOCK_M, BLOCK_V, BLOCK_D, GROUP)
            rows = m0 + tl.arange(0, BLOCK_M)
            cols = c0 + tl.arange(0, BLOCK_V)
            row_ok = rows < n
            lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
            gs = tl.load(GS + rows, mask=row_ok, other=0.0)
            gt = tl.load(GT + rows, mask=row_ok, other=0.0)
            t = tl.load(T + rows, mask=row_ok, other=-1) - v0
            p = _p_tile(acc, cols, lse, gs, gt, t, softcap, HAS_SOFTCAP)
            ok = row_ok[:, None] & (cols < c)[None, :]
            tl.store(P + rows.to(tl.int64)[:, None] * stride_p + cols[None, :], p.to(P.dtype.element_ty), mask=ok)


def sm_count(device: torch.device) -> int:
    """SMs of ``device``: the persistent passes' program count and ``cce_gemm.wave_cols``'s wave width. Off the GPU
    (the interpreter) a few, so a persistent tile loop still runs more than once."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 3


class Descriptors:
    """The TMA descriptors of h and w for one tiling: the tiling travels with them, so a launch cannot read tiles of
    another shape than its kernel's blocks."""

    def __init__(self, h: Tensor, w: Tensor, cfg: KernelConfig):
        self.cfg = cfg
        self.e = TensorDescriptor.from_tensor(h, [cfg.block_m, cfg.block_d])
        self.c = TensorDescriptor.from_tensor(w, [cfg.block_v, cfg.block_d])
        # persistent programs: one per SM, each holding one tile's pipeline. Read once here, not at each of a
        # backward's chunk launches.
        self.sms = sm_count(h.device)

    def programs(self, n: int, c: int) -> int:
        """Programs of one launch over [n, c]: one per SM, never more than tiles."""
        return max(1, min(self.sms, triton.cdiv(n, self.cfg.block_m) * triton.cdiv(c, self.cfg.block_v)))

    def meta(self, softcap: float | None) -> dict:
        cfg = self.cfg
        return dict(
            HAS_SOFTCAP=softcap is not None, BLOCK_M=cfg.block_m, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d,
            GROUP=cfg.group_m, FLATTEN=cfg.flatten, WS=cfg.warp_specialize, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )  # fmt: skip


def lse_pass(
    h: Tensor,
    w: Tensor,
    t32: Tensor,
    n_valid: int,
    softcap: float | None,
    budget: int,
    cfg: KernelConfig | None = None,
) -> tuple[Tensor, Tensor]:
    """(lse [n] fp32, target logit [n] fp32) of columns [0, n_valid) of ``w`` (n_valid > 0). The tile partials,
    4·n bytes per vocabulary tile, stay within ``budget`` bytes but hold one tile at least: at 8192 rows and 48 MB
    one launch covers 1536 tiles, the whole slice."""
    n, d = h.shape
    desc = Descriptors(h, w, cfg or FWD)
    tiles = max(1, budget // (4 * n))
    cols = tiles * desc.cfg.block_v
    part = torch.empty(min(tiles, triton.cdiv(n_valid, desc.cfg.block_v)), n, dtype=torch.float32, device=h.device)
    tlogit = torch.zeros(n, dtype=torch.float32, device=h.device)
    lse = None
    for v0 in range(0, n_valid, cols):
        c = min(cols, n_valid - v0)
        progs = desc.programs(n, c)
        _lse_kernel[(progs,)](
            desc.e, desc.c, t32, part, tlogit, n, c, v0, d, progs, float(softcap or 1.0), **desc.meta(softcap)
        )
        chunk = torch.logsumexp(part[: triton.cdiv(c, desc.cfg.block_v)], 0)
        lse = chunk if lse is None else torch.logaddexp(lse, chunk, out=lse)
    return lse, tlogit


def grad_pass(
    desc: Descriptors,
    t32: Tensor,
    lse: Tensor,
    gs: Tensor,
    gt: Tensor,
    v0: int,
    p: Tensor,
    softcap: float | None,
) -> None:
    """P of columns [v0, v0 + p.shape[1]) into ``p`` ([n, c], the input dtype), through ``desc`` (h's and w's
    descriptors, built once per backward: ``Descriptors(h, w, BWD)``)."""
    n, c = p.shape
    d = desc.e.shape[1]
    progs = desc.programs(n, c)
    args = (desc.e, desc.c, p, lse, gs, gt, t32, n, c, v0, p.stride(0), d, progs, float(softcap or 1.0))
    _grad_kernel[(progs,)](*args, **desc.meta(softcap))
