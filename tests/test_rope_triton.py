"""The RoPE Triton kernel (ops/rope_kernels.py) under TRITON_INTERPRET=1 (CPU) and on a GPU, against the fp64
reference: odd head counts, strided input and output, shared and per-sequence positions, the inverse rotation."""

from __future__ import annotations

import pytest
import torch
from interpret import check_under_interpreter, needs_interpreter

from megasparse.ops.attention import rope_tables
from megasparse.ops.rope_kernels import rope_reference

TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


def _cases(device: str):
    for dtype in (torch.float32, torch.bfloat16):
        for bsz, heads, t, d, per_seq in [(1, 3, 5, 8, False), (2, 5, 7, 64, True), (3, 12, 33, 128, True)]:
            g = torch.Generator(device=device).manual_seed(heads * 100 + t)
            base = torch.randn(t, bsz, heads + 2, d, generator=g, device=device).to(dtype)
            x = base[:, :, 1 : heads + 1].permute(1, 2, 0, 3)  # a strided [b, h, t, d] view, as in attention
            cos, sin = rope_tables(64, d, 10000.0, device)
            if per_seq:
                pos = torch.stack([torch.randperm(64, generator=g, device=device)[:t] for _ in range(bsz)])
            else:
                pos = torch.arange(3, 3 + t, device=device)
            yield dtype, x, cos, sin, pos


def _check(device: str = "cpu") -> None:
    from megasparse.ops.rope_kernels import _kernel_ok, rope_into

    for dtype, x, cos, sin, pos in _cases(device):
        for inverse in (False, True):
            out = torch.empty(x.shape[2], x.shape[0], x.shape[1], x.shape[3], dtype=dtype, device=device)
            view = out.permute(1, 2, 0, 3)
            assert _kernel_ok(x, view)
            rope_into(view, x, cos, sin, pos, inverse)
            ref = rope_reference(x.double(), cos.double(), sin.double(), pos, inverse)
            err = ((view.double() - ref).norm() / ref.norm()).item()
            assert err < TOL[dtype], (dtype, tuple(x.shape), inverse, err)
        back = rope_reference(
            rope_reference(x.double(), cos.double(), sin.double(), pos), cos.double(), sin.double(), pos, True
        )
        assert torch.allclose(back, x.double(), atol=1e-12)  # the reference's inverse undoes it


@needs_interpreter
def test_rope_kernel_matches_fp64_reference_under_interpreter() -> None:
    check_under_interpreter("test_rope_triton")


def test_reference_is_the_rotation_of_each_pair() -> None:
    """Position p rotates pair (x_i, x_{i+d/2}) by p·θ_i: check one entry by hand."""
    d = 4
    cos, sin = rope_tables(8, d, 100.0, "cpu", torch.float64)
    x = torch.randn(1, 1, 1, d, dtype=torch.float64)
    y = rope_reference(x, cos, sin, torch.tensor([5]))
    ang = 5 * 100.0 ** (-0 / d)
    assert torch.allclose(
        y[0, 0, 0, 0],
        x[0, 0, 0, 0] * torch.cos(torch.tensor(ang, dtype=torch.float64))
        - x[0, 0, 0, 2] * torch.sin(torch.tensor(ang, dtype=torch.float64)),
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_rope_kernel_on_gpu() -> None:
    _check("cuda")
