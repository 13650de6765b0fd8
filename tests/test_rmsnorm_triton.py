"""RMSNorm Triton kernels under TRITON_INTERPRET=1 (CPU) against an fp64 reference: odd shapes, fp32/bf16."""

from __future__ import annotations

import pytest
import torch
from interpret import check_under_interpreter, needs_interpreter

from megasparse.ops.rmsnorm_kernels import rms_backward_reference, rms_forward_reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _check() -> None:
    from megasparse.ops.rmsnorm_kernels import rms_backward, rms_forward

    for dtype in (torch.float32, torch.bfloat16):
        for n, h in [(1, 8), (7, 48), (13, 100), (70, 64)]:
            g = torch.Generator().manual_seed(n * 1000 + h)
            x = torch.randn(n, h, generator=g).to(dtype)
            w = (1 + 0.3 * torch.randn(h, generator=g)).float()
            dy = torch.randn(n, h, generator=g).to(dtype)
            y = rms_forward(x, w, 1e-5)
            dx, dw = rms_backward(x, w, dy, 1e-5)
            yr = rms_forward_reference(x.double(), w.double(), 1e-5)
            dxr, dwr = rms_backward_reference(x.double(), w.double(), dy.double(), 1e-5)
            for got, ref in ((y, yr), (dx, dxr), (dw, dwr)):
                assert torch.isfinite(got).all()
                err = ((got.double() - ref).norm() / ref.norm()).item()
                assert err < TOL[dtype], (dtype, n, h, err)
            assert y.dtype == dx.dtype == dtype and dw.dtype == torch.float32
            # kept rows only (the compact backward): dx of those rows, dw over them, x read through the indices
            rows = torch.arange(0, n, 3)
            dxk, dwk = rms_backward(x, w, dy[rows], 1e-5, rows=rows)
            dxkr, dwkr = rms_backward_reference(x.double()[rows], w.double(), dy.double()[rows], 1e-5)
            assert dxk.shape == (rows.numel(), h)
            for got, ref in ((dxk, dxkr), (dwk, dwkr)):
                err = ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                assert err < TOL[dtype], ("rows", dtype, n, h, err)


@needs_interpreter
def test_rmsnorm_kernels_match_fp64_reference_under_interpreter() -> None:
    check_under_interpreter("test_rmsnorm_triton")


def test_reference_backward_is_the_autograd_gradient() -> None:
    x = torch.randn(5, 12, dtype=torch.float64, requires_grad=True)
    w = torch.randn(12, dtype=torch.float64, requires_grad=True)
    g = torch.randn(5, 12, dtype=torch.float64)
    rms_forward_reference(x, w, 1e-6).backward(g)
    dx, dw = rms_backward_reference(x.detach(), w.detach(), g, 1e-6)
    assert torch.allclose(dx, x.grad) and torch.allclose(dw, w.grad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,h", [(4096, 2048), (2457, 4096), (3, 5120)])
def test_rmsnorm_kernels_on_gpu(n: int, h: int) -> None:
    from megasparse.ops.rmsnorm_kernels import rms_backward, rms_forward

    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(n, h, device="cuda").to(dtype)
        w = 1 + 0.3 * torch.randn(h, device="cuda")
        dy = torch.randn(n, h, device="cuda").to(dtype)
        y = rms_forward(x, w, 1e-5)
        dx, dw = rms_backward(x, w, dy, 1e-5)
        yr = rms_forward_reference(x.double(), w.double(), 1e-5)
        dxr, dwr = rms_backward_reference(x.double(), w.double(), dy.double(), 1e-5)
        for got, ref in ((y, yr), (dx, dxr), (dw, dwr)):
            assert ((got.double() - ref).norm() / ref.norm()).item() < TOL[dtype]
        rows = torch.arange(0, n, 2, device="cuda")
        dxk, dwk = rms_backward(x, w, dy[rows], 1e-5, rows=rows)
        dxkr, dwkr = rms_backward_reference(x.double()[rows], w.double(), dy.double()[rows], 1e-5)
        for got, ref in ((dxk, dxkr), (dwk, dwkr)):
            assert ((got.double() - ref).norm() / ref.norm()).item() < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_glu_backward_kept_rows_on_gpu() -> None:
    from megasparse.ops.glu import glu_backward_triton

    z = torch.randn(4096, 2 * 5632, device="cuda", dtype=torch.bfloat16)
    go = torch.randn(4096, 5632, device="cuda", dtype=torch.bfloat16)
    rows = torch.randperm(4096, device="cuda")[:2458].sort().values
    full = glu_backward_triton(z, go, "swiglu")
    kept = glu_backward_triton(z, go[rows].contiguous(), "swiglu", rows=rows)
    assert torch.equal(kept, full[rows])
