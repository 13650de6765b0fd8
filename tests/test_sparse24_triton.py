"""Triton kernels of megasparse.sparse24 under TRITON_INTERPRET=1 on CPU, against their torch references.

TRITON_INTERPRET must be set before the kernels are decorated, so each case runs this file as a
script in a fresh interpreter with the variable set; pytest only launches and checks it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CASES = ("masks", "mvue", "activation", "pack")


@pytest.mark.parametrize("case", CASES)
def test_triton_kernel_interpreted(case):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, __file__, case], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"ok {case}" in r.stdout


def _masks() -> None:
    from megasparse.sparse24.masks import (
        is_transposable_24,
        kept_magnitude,
        transposable_mask_reference,
        transposable_mask_triton,
    )

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for shape in ((4, 4), (12, 68), (32, 320)):  # 320/4 = 80 blocks: a partial second strip at block_b=64
            w = torch.randn(*shape).to(dtype)
            w[:4, :4] = 0.5  # ties
            m = transposable_mask_triton(w)
            r = transposable_mask_reference(w)
            assert m.dtype == torch.bool and m.shape == w.shape
            assert is_transposable_24(m), (dtype, shape)
            torch.testing.assert_close(kept_magnitude(w, m), kept_magnitude(w, r), rtol=0, atol=0)
    w = torch.randn(8, 16)
    w2 = torch.cat([w, torch.zeros(8, 16)], 1)[:, :16]  # strided view (row stride 32)
    assert torch.equal(transposable_mask_triton(w2), transposable_mask_reference(w))


def _mvue() -> None:
    from megasparse.sparse24.mvue import mvue24_reference, mvue24_triton

    for dtype in (torch.float32, torch.bfloat16):
        for dim, shape in ((0, (20, 36)), (1, (36, 20)), (0, (4, 200))):
            x = (torch.randn(*shape) * torch.rand(*shape) * 4).to(dtype)
            x.view(-1)[:4] = 0
            n_groups, cols = (shape[0] // 4, shape[1]) if dim == 0 else (shape[1] // 4, shape[0])
            u = torch.rand(n_groups, cols)
            ref = mvue24_reference(x.float(), dim, u=u).to(dtype)
            out = mvue24_triton(x, dim, u=u)
            torch.testing.assert_close(out, ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)
    x = torch.randn(16, 24)
    buf = torch.empty(24, 16)
    mvue24_triton(x, 0, u=torch.full((4, 24), 0.37), out=buf.t())  # write ∇Yᵀ directly
    torch.testing.assert_close(buf.t(), mvue24_reference(x, 0, u=torch.full((4, 24), 0.37)))
    a, b = mvue24_triton(x, 0, seed=5), mvue24_triton(x, 0, seed=5)
    assert torch.equal(a, b) and not torch.equal(a, mvue24_triton(x, 0, seed=6))
    # unbiased over seeds
    acc = sum(mvue24_triton(x.double().float(), 0, seed=s).double() for s in range(400)) / 400
    assert (acc - x.double()).abs().max() < 0.6


def _activation() -> None:
    from megasparse.sparse24.activation import (
        GatedActivationFn,
        gated_activation_reference,
        glu_backward_triton,
        glu_forward_triton,
    )

    for kind in ("swiglu", "geglu"):
        for col_major in (False, True):
            z = torch.randn(37, 2 * 21, dtype=torch.float64)
            zz = z.t().contiguous().t() if col_major else z
            zt = zz.float()
            zt = zt.t().contiguous().t() if col_major else zt
            out = glu_forward_triton(zt, kind)
            assert (out.stride(0) == 1) == col_major
            zr = z.clone().requires_grad_(True)
            ref = gated_activation_reference(zr, kind)
            torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)
            go = torch.randn(37, 21, dtype=torch.float64)
            ref.backward(go)
            dz = glu_backward_triton(zt, go.float(), kind)
            torch.testing.assert_close(dz.double(), zr.grad, rtol=1e-5, atol=1e-5)
        zb = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
        y = GatedActivationFn.apply(zb, kind)
        y.float().sum().backward()
        zr = zb.detach().double().requires_grad_(True)
        gated_activation_reference(zr, kind).sum().backward()
        torch.testing.assert_close(zb.grad.double(), zr.grad, rtol=2e-2, atol=2e-2)


def _pack() -> None:
    import megasparse.sparse24.linear as lin
    from megasparse.sparse24.masks import transposable_mask_reference

    w = torch.randn(24, 40, dtype=torch.bfloat16)
    m = transposable_mask_reference(w)
    # run the Triton kernel directly (the public wrapper only uses it for CUDA tensors)
    for src, mk in ((w, m), (w.t(), m.t())):
        r, c = src.shape
        out = torch.full((r, c // 2), float("nan"), dtype=w.dtype)
        m8 = mk.view(torch.uint8)
        br, bg = (128, 8) if src.stride(0) == 1 else (8, 128)
        grid = (lin.triton.cdiv(r, br), lin.triton.cdiv(c // 4, bg))
        lin._pack_kernel[grid](
            src, m8, out, r, c // 4, src.stride(0), src.stride(1), m8.stride(0), m8.stride(1), out.stride(0),
            BLOCK_R=br, BLOCK_G=bg,
        )  # fmt: skip
        assert torch.equal(out, lin.pack_values_reference(src, mk))


if __name__ == "__main__":
    import torch

    torch.manual_seed(0)
    {"masks": _masks, "mvue": _mvue, "activation": _activation, "pack": _pack}[sys.argv[1]]()
    print(f"ok {sys.argv[1]}")
