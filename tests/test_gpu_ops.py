"""GPU paths of the filter-aware ops (compiled RMSNorm, Triton SwiGLU, CUDA flash attention) vs fp64 autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megasparse.ops.attention import attention, rope_tables
from megasparse.ops.compact import CompactGrad, KeepMeta
from megasparse.ops.rowwise import rms_norm, swiglu

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _check(fn, ref, x, keep_rows, tol):
    """Dense and compact backward of ``fn`` against ``ref`` in fp64 (compact = gradient on kept rows only)."""
    x = x.requires_grad_()
    y = fn(x)
    g = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, g)
    x64 = x.detach().double().requires_grad_()
    y64 = ref(x64)
    (dx64,) = torch.autograd.grad(y64, x64, g.double())
    assert rel(y, y64) < tol and rel(dx, dx64) < tol
    meta = KeepMeta(keep_rows, y.reshape(-1, y.shape[-1]).shape[0], y.shape[1] if y.dim() == 3 else 1)
    gc = CompactGrad(g.reshape(-1, g.shape[-1])[keep_rows], meta, y.shape)
    y = fn(x)
    y.backward(gc)
    assert rel(x.grad.reshape(-1, x.shape[-1])[keep_rows], dx64.reshape(-1, x.shape[-1])[keep_rows]) < tol


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
def test_rowwise_ops(dtype, tol):
    s, b, h = 257, 2, 384
    keep = torch.sort(torch.randperm(s * b, device="cuda")[:300]).values
    w = (1 + 0.1 * torch.randn(h, device="cuda")).to(torch.float32)
    x = torch.randn(s, b, h, device="cuda", dtype=dtype)
    _check(
        lambda t: rms_norm(t, w, 1e-5),
        lambda t: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double(),
        x,
        keep,
        tol,
    )
    z = torch.randn(s, b, 2 * 352, device="cuda", dtype=dtype)
    _check(swiglu, lambda t: F.silu(t[..., :352]) * t[..., 352:], z, keep, tol)


def test_attention_dense_bf16():
    s, b, nq, nkv, d = 512, 2, 8, 2, 64
    cos, sin = rope_tables(s, d, 10000.0, "cuda")
    qkv = torch.randn(s, b, (nq + 2 * nkv) * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = attention(qkv, nq, nkv, cos, sin)
    g = torch.randn_like(out)
    (dq,) = torch.autograd.grad(out, qkv, g)
    x = qkv.detach().double().requires_grad_()
    q, k, v = x.view(s, b, nq + 2 * nkv, d).split([nq, nkv, nkv], 2)

    def rope(t):
        c, sn = cos[:, None, None].double(), sin[:, None, None].double()
        t1, t2 = t.chunk(2, -1)
        return torch.cat([t1 * c - t2 * sn, t2 * c + t1 * sn], -1)

    q, k = rope(q).permute(1, 2, 0, 3), rope(k).permute(1, 2, 0, 3).repeat_interleave(nq // nkv, 1)
    v = v.permute(1, 2, 0, 3).repeat_interleave(nq // nkv, 1)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(s, b, -1)
    (dref,) = torch.autograd.grad(ref, x, g.double())
    assert rel(out, ref) < 2e-2 and rel(dq, dref) < 2e-2


def test_attention_uses_cudnn_on_hopper():
    """The fast kernel is really the one that ran (a silent fall-back to flash costs ~10% of a step)."""
    from megasparse.ops import attention as attn

    test_attention_dense_bf16()
    if torch.cuda.get_device_capability()[0] >= 9:
        assert attn._CUDNN["ok"]


@pytest.mark.parametrize("keep_fraction", [0.6, 1.0])
def test_attention_compact_backward_uneven_sequences_matches_cpu(keep_fraction):
    """The padded batched compact backward on CUDA (bf16 flash) against the same op on CPU in fp32."""
    torch.manual_seed(1)
    s, b, nq, nkv, d = 256, 3, 8, 2, 64
    cos, sin = rope_tables(s, d, 10000.0, "cuda")
    qkv = torch.randn(s, b, (nq + 2 * nkv) * d, device="cuda")
    n = s * b
    keep_rows = torch.randperm(n, device="cuda")[: int(keep_fraction * n)].sort().values  # uneven per sequence
    g = torch.randn(keep_rows.numel(), nq * d, device="cuda")

    def compact_grad(x, c, sn):
        x = x.detach().requires_grad_()
        out = attention(x, nq, nkv, c, sn)
        meta = KeepMeta(keep_rows.to(x.device), n, b)
        out.backward(CompactGrad(g.to(x.device, x.dtype), meta, out.shape))
        return x.grad.reshape(n, -1)[keep_rows.to(x.device)].float().cpu()

    gpu = compact_grad(qkv.bfloat16(), cos, sin)
    cpu = compact_grad(qkv.cpu(), cos.cpu(), sin.cpu())
    assert rel(gpu, cpu) < 3e-2


@pytest.mark.parametrize("shape", [(4096, 1000, 2048), (777, 513, 96)])
def test_accumulate_mm_adds_an_fp32_product_in_place(shape):
    """The weight-gradient accumulation (parallel/layers.py): out += a·b in fp32 from bf16 operands, in place."""
    from megasparse.ops.wgrad import accumulate_mm

    m, n, k = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    b = torch.randn(k, n, device="cuda", generator=g).bfloat16()
    out = torch.randn(m, n, device="cuda", generator=g)
    ref = out.double() + a.double() @ b.double()
    ptr = out.data_ptr()
    accumulate_mm(out, a, b)
    assert out.data_ptr() == ptr
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-5, err  # fp32 output: far below bf16's 4e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sparse_gemm_verdict_is_printed_once_per_shape(capsys):
    """The run says which 2:4 GEMM shapes run on cuSPARSELt and which fall back to dense GEMMs."""
    from megasparse.sparse24 import linear as lin

    lin.PLANS.reset()
    dev = torch.device("cuda")
    a = lin.decide(256, 128, 512, torch.bfloat16, dev, False)
    b = lin.decide(256, 128, 512, torch.bfloat16, dev, False)
    out = capsys.readouterr().out
    assert a is b and out.count("sparse24: shape [256, 128] x 512 rows bfloat16") == 1
    assert ("-> cuSPARSELt" in out) == a["sparse"]
