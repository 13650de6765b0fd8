"""Launchers of the CCE kernels and the dispatch of the shard maths to a backend.

``shard_forward`` / ``shard_backward`` are the per-slice pieces every output loss is built from (lse partial +
target logit partial; backward for a given merged lse). Backends:

* ``gemm``: GEMMs over bounded vocabulary chunks (``cce_gemm.py``; default on CUDA, decision 0203), its logit
  passes fused in Triton on sm_90+ (``cce_fused.py``, decision 0204);
* ``triton``: the tile kernels of ``cce_kernels.py`` (gradient filtering and the vocabulary sort, least memory);
* ``reference``: the chunked pure-torch maths (``reference.py``; default on CPU, runs at real vocabulary sizes);
* ``materialized``: whole [rows, V_local] fp32 logits (``materialized.py``; ``loss.impl=materialized``).

Which one runs is configuration (``loss.backend``, ``loss.impl``), never the environment; CPU tests run the kernels
interpreted with ``backend="triton"`` and TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megasparse.loss.cce_gemm import gemm_shard_backward, gemm_shard_forward
from megasparse.loss.cce_kernels import KernelConfig, _bwd_kernel, _fwd_kernel, triton
from megasparse.loss.materialized import materialized_shard_backward, materialized_shard_forward
from megasparse.loss.reference import torch_shard_backward, torch_shard_forward
from megasparse.loss.rows import add_target_term

FWD_CONFIG = KernelConfig(128, 256, 64, 8, 3)
BWD_CONFIG = KernelConfig(128, 128, 64, 4, 3, 16, 128)
_SMALL = KernelConfig(16, 32, 16, 4, 1, 2)  # interpreter / tiny problems
# fp32 inputs: the bf16 tiles' shared-memory pipeline (3 stages of 4-byte tiles) exceeds Hopper's 227 KB
_FP32 = {"fwd": KernelConfig(128, 256, 32, 8, 2), "bwd": KernelConfig(128, 128, 64, 8, 2, 8)}


def backend_for(t: Tensor) -> str:
    """gemm on CUDA (when triton is installed), the chunked torch reference otherwise."""
    return "gemm" if (t.is_cuda and triton is not None) else "reference"


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
    backend = backend or backend_for(h)
    if backend == "gemm":
        return gemm_shard_forward(h, w, tgt, n_valid, softcap)
    if backend == "triton":
        return triton_shard_forward(h, w, tgt, n_valid, softcap)
    if backend == "materialized":
        return materialized_shard_forward(h, w, tgt, n_valid, softcap)
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
    accum_fp32: bool = True,
    backend: str | None = None,
    dc_out: Tensor | None = None,
    scratch: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """(dE, dC) of this slice for dlogits = gs·softmax(logits − merged lse) − gt·onehot(tgt).

    ``dc_out`` (fp32, the weight's gradient bucket slice): dC is added into it instead of returned (None then);
    the GEMM and materialised backends write it from their GEMMs directly (``ops/wgrad.py``). ``scratch``: bytes
    the GEMM backend's chunk buffer may take (``loss.cce_scratch_mb``)."""
    backend = backend or backend_for(h)
    if backend == "gemm":  # exact: its FLOPs are dense GEMMs, skipping entries would save nothing (decision 0203)
        return gemm_shard_backward(h, w, tgt, lse, gs, gt, n_valid, softcap, accum_fp32, dc_out=dc_out, scratch=scratch)
    if backend == "materialized":  # no filtering: the logits exist anyway, skipping entries saves nothing
        return materialized_shard_backward(h, w, tgt, lse, gs, gt, n_valid, softcap, dc_out)
    if backend == "triton":
        d_e, d_c = triton_shard_backward(h, w, tgt, lse, gs, gt, n_valid, softcap, filter_eps, perm, accum_fp32)
    else:
        d_e, d_c = torch_shard_backward(h, w, tgt, lse, gs, gt, n_valid, softcap, filter_eps, perm)
    if dc_out is None:
        return d_e, d_c
    dc_out.add_(d_c)
    return d_e, None
