"""Minimum-variance unbiased 2:4 pruning (MVUE) of output gradients.

For the weight-gradient GEMM ∇W = ∇Yᵀ·X the output gradient ∇Y [tokens, out] is pruned 2:4
along tokens, so ∇Yᵀ is row-wise 2:4 and the GEMM can run on sparse tensor cores. Each group
of four a_0..a_3 keeps two entries, entry i with probability q_i, scaled to a_i / q_i, so
E[out] = a exactly. The total variance Σ a_i²(1/q_i − 1) is minimised under Σ q_i = 2,
q_i ≤ 1 by q_i ∝ |a_i| capped at 1 ("water filling"): with S = Σ|a_i| and m = max|a_i|,
q_i = 2|a_i|/S when 2m ≤ S, else q = 1 for the largest and |a_i|/(S − m) for the rest.
A pair with exactly these marginals is drawn by systematic sampling: lay the q_i end to end
on [0, 2) and keep the entries covering u and u + 1 for one uniform u per group.

Triton kernel, launcher and a pure-torch reference live together; both take the uniforms as
an explicit tensor (tests) or draw them from a seed (kernel: philox; reference: torch.Generator).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None


def mvue_probabilities(a: torch.Tensor) -> torch.Tensor:
    """Keep probabilities q [..., 4] of the MVUE for groups a [..., 4] (Σq = 2 where a has ≥ 2 non-zeros)."""
    x = a.abs().to(torch.float64 if a.dtype == torch.float64 else torch.float32)
    s = x.sum(-1, keepdim=True)
    m = x.amax(-1, keepdim=True)
    capped = 2 * m > s
    rest = torch.where(s - m > 0, x / (s - m).clamp_min(1e-30), torch.zeros_like(x))
    q_cap = torch.where(x == m, torch.ones_like(x), rest)
    q_free = torch.where(s > 0, 2 * x / s.clamp_min(1e-30), torch.zeros_like(x))
    return torch.where(capped, q_cap, q_free)


def mvue_variance(a: torch.Tensor) -> torch.Tensor:
    """Analytic per-entry variance a²(1/q − 1) of the MVUE (0 where q = 0, since then a = 0)."""
    q = mvue_probabilities(a)
    x = a.to(q.dtype)
    return torch.where(q > 0, x * x * (1 / q.clamp_min(1e-30) - 1), torch.zeros_like(x))


def _select(q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Systematic sampling: which of the 4 intervals (lengths q, total 2) cover u and u + 1."""
    total = q.sum(-1, keepdim=True)
    qn = torch.where(total > 0, q * (2 / total.clamp_min(1e-30)), q)  # absorb rounding so points land inside
    hi = qn.cumsum(-1)
    lo = hi - qn
    u = u.unsqueeze(-1)
    return ((lo <= u) & (u < hi)) | ((lo <= u + 1) & (u + 1 < hi))


def mvue24_reference(
    x: torch.Tensor, dim: int = 0, u: torch.Tensor | None = None, generator: torch.Generator | None = None
) -> torch.Tensor:
    """MVUE 2:4 prune of 2-D ``x`` along ``dim`` (size a multiple of 4); ``u``: one uniform per group.

    Groups are 4 consecutive entries along ``dim``; ``u`` has shape [size(dim) // 4, size(other)] in
    the orientation of dim 0 (so the same tensor serves the kernel and the reference).
    """
    if x.dim() != 2 or x.shape[dim] % 4:
        raise ValueError(f"mvue24: need a 2-D tensor whose dim {dim} is a multiple of 4, got {list(x.shape)}")
    xt = x if dim == 0 else x.t()
    n, c = xt.shape
    groups = xt.reshape(n // 4, 4, c).permute(0, 2, 1)  # [G, c, 4]
    if u is None:
        u = torch.rand(n // 4, c, generator=generator, device=x.device)
    q = mvue_probabilities(groups)
    keep = _select(q, u.to(q.dtype))
    vals = torch.where(keep, groups.to(q.dtype) / q.clamp_min(1e-30), torch.zeros_like(q))
    out = vals.permute(0, 2, 1).reshape(n, c).to(x.dtype)
    return out if dim == 0 else out.t()


if triton is not None:

    @triton.jit
    def _mvue_kernel(
        x_ptr,
        out_ptr,
        u_ptr,
        seed,
        n_groups,
        n_cols,
        sx0,
        sx1,
        so0,
        so1,
        HAS_U: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        g = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        ok = (g[:, None] < n_groups) & (c[None, :] < n_cols)
        base = (4 * g[:, None]) * sx0 + c[None, :] * sx1
        a0 = tl.load(x_ptr + base, mask=ok, other=0.0).to(tl.float32)
        a1 = tl.load(x_ptr + base + sx0, mask=ok, other=0.0).to(tl.float32)
        a2 = tl.load(x_ptr + base + 2 * sx0, mask=ok, other=0.0).to(tl.float32)
        a3 = tl.load(x_ptr + base + 3 * sx0, mask=ok, other=0.0).to(tl.float32)
        gid = g[:, None] * n_cols + c[None, :]
        if HAS_U:
            u = tl.load(u_ptr + gid, mask=ok, other=0.0)
        else:
            u = tl.rand(seed, gid)
        x0 = tl.abs(a0)
        x1 = tl.abs(a1)
        x2 = tl.abs(a2)
        x3 = tl.abs(a3)
        s = x0 + x1 + x2 + x3
        m = tl.maximum(tl.maximum(x0, x1), tl.maximum(x2, x3))
        capped = 2 * m > s
        rest_den = tl.where(s - m > 0, s - m, 1.0)
        free_den = tl.where(s > 0, s, 1.0)
        q0 = tl.where(capped, tl.where(x0 == m, 1.0, x0 / rest_den), 2 * x0 / free_den)
        q1 = tl.where(capped, tl.where(x1 == m, 1.0, x1 / rest_den), 2 * x1 / free_den)
        q2 = tl.where(capped, tl.where(x2 == m, 1.0, x2 / rest_den), 2 * x2 / free_den)
        q3 = tl.where(capped, tl.where(x3 == m, 1.0, x3 / rest_den), 2 * x3 / free_den)
        tot = q0 + q1 + q2 + q3
        scale = tl.where(tot > 0, 2 / tl.where(tot > 0, tot, 1.0), 1.0)
        h0 = q0 * scale
        h1 = h0 + q1 * scale
        h2 = h1 + q2 * scale
        h3 = h2 + q3 * scale
        v = u + 1
        k0 = (u < h0) | (v < h0)
        k1 = ((h0 <= u) & (u < h1)) | ((h0 <= v) & (v < h1))
        k2 = ((h1 <= u) & (u < h2)) | ((h1 <= v) & (v < h2))
        k3 = ((h2 <= u) & (u < h3)) | ((h2 <= v) & (v < h3))
        ob = (4 * g[:, None]) * so0 + c[None, :] * so1
        ty = out_ptr.dtype.element_ty
        tl.store(out_ptr + ob, tl.where(k0, a0 / tl.where(q0 > 0, q0, 1.0), 0.0).to(ty), mask=ok)
        tl.store(out_ptr + ob + so0, tl.where(k1, a1 / tl.where(q1 > 0, q1, 1.0), 0.0).to(ty), mask=ok)
        tl.store(out_ptr + ob + 2 * so0, tl.where(k2, a2 / tl.where(q2 > 0, q2, 1.0), 0.0).to(ty), mask=ok)
        tl.store(out_ptr + ob + 3 * so0, tl.where(k3, a3 / tl.where(q3 > 0, q3, 1.0), 0.0).to(ty), mask=ok)


def mvue24_triton(
    x: torch.Tensor,
    dim: int = 0,
    seed: int = 0,
    u: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_g: int = 16,
    block_c: int = 128,
) -> torch.Tensor:
    """Triton MVUE 2:4 along ``dim``; ``out`` may be any-strided (e.g. ``buf.t()`` to write ∇Yᵀ directly)."""
    if triton is None:
        raise RuntimeError("triton is not installed; use mvue24_reference")
    if x.dim() != 2 or x.shape[dim] % 4:
        raise ValueError(f"mvue24: need a 2-D tensor whose dim {dim} is a multiple of 4, got {list(x.shape)}")
    if out is None:
        out = torch.empty_like(x)
    xv, ov = (x, out) if dim == 0 else (x.t(), out.t())
    n, c = xv.shape
    if u is not None:
        u = u.to(device=x.device, dtype=torch.float32).contiguous()
    grid = (triton.cdiv(n // 4, block_g), triton.cdiv(c, block_c))
    _mvue_kernel[grid](
        xv, ov, u if u is not None else xv, int(seed) & 0x7FFFFFFF, n // 4, c, xv.stride(0), xv.stride(1),
        ov.stride(0), ov.stride(1), HAS_U=u is not None, BLOCK_G=block_g, BLOCK_C=block_c,
    )  # fmt: skip
    return out


def mvue24(x: torch.Tensor, dim: int = 0, seed: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """MVUE 2:4 prune along ``dim``: Triton on GPU; on CPU the reference with a generator seeded by ``seed``."""
    if x.is_cuda and triton is not None:
        return mvue24_triton(x, dim, seed=seed, out=out)
    gen = torch.Generator(device=x.device).manual_seed(int(seed))
    r = mvue24_reference(x, dim, generator=gen)
    if out is not None:
        out.copy_(r)
        return out
    return r
