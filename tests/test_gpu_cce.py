"""Triton CCE kernels on the GPU at the issue's odd shapes (V 50257, D 2304, 1037 tokens) against fp64."""

from __future__ import annotations

import pytest
import torch

from megasparse.loss import LossConfig, vocab_parallel_loss

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("backend", ["gemm", "triton"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    "softcap,z,eps,acc32",
    [(None, 0.0, None, False), (30.0, 1e-4, None, False), (None, 0.0, 2.0**-12, False), (None, 0.0, 2.0**-12, True)],
    ids=["exact", "cap-z", "filter", "filter-fp32dE"],
)
def test_cce_matches_fp64(dtype, tol, softcap, z, eps, acc32, backend):
    n, v, d = 1037, 50257, 2304
    g = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    h = torch.randn(n, d, device="cuda", generator=g).to(dtype)
    w = (torch.randn(v, d, device="cuda", generator=g) * 2 / d**0.5).to(dtype)
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[::7] = -100
    gout = torch.rand(n, device="cuda", generator=g) + 0.5
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    cfg = LossConfig(
        impl="cce", softcap=softcap, z_loss=z, filter_eps=eps, sort_vocab=True, grad_accum_fp32=acc32, backend=backend
    )
    loss = vocab_parallel_loss(hh, ww, t, cfg, vocab_start=0, vocab_size=v)
    loss.backward(gout)

    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    lg = h64 @ w64.T
    if softcap:
        lg = softcap * torch.tanh(lg / softcap)
    lse = torch.logsumexp(lg, 1)
    valid = t != -100
    ref = lse - lg.gather(1, t.clamp(min=0)[:, None]).squeeze(1) + z * lse * lse
    ref = torch.where(valid, ref, 0.0)
    ref.backward(gout.double())
    tol_g = tol if eps is None else max(tol, 5e-2)  # filtering drops softmax entries below eps per tile
    assert _rel(loss, ref) < tol
    assert _rel(hh.grad, h64.grad) < tol_g
    assert _rel(ww.grad, w64.grad) < tol_g
    assert torch.all(hh.grad[~valid] == 0)


@pytest.mark.parametrize("backend", ["gemm", "triton"])
def test_exact_mode_bitwise_reproducible(backend):
    """Exact mode orders the locked adds (tickets), and the GEMM backend has no atomics: repeated backward passes
    agree bit for bit."""
    n, v, d = 2053, 50257, 2304
    g = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    h = torch.randn(n, d, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(v, d, device="cuda", generator=g) * 2 / d**0.5).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[: n // 4] = t[0]  # many rows share a target: the target pass's scatter has to be ordered too
    cfg = LossConfig(impl="cce", filter_eps=None, backend=backend)
    grads = []
    for _ in range(3):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        vocab_parallel_loss(hh, ww, t, cfg, vocab_start=0, vocab_size=v).sum().backward()
        grads.append((hh.grad, ww.grad))
    for de, dc in grads[1:]:
        assert torch.equal(de, grads[0][0]) and torch.equal(dc, grads[0][1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_fused_logit_passes_match_cublas_pass(dtype, softcap):
    """The GEMM backend's fused logit passes (cce_fused.py) against its cuBLAS pass: ragged rows and vocabulary, TP
    padding rows, targets in another slice, a forward split over several launches."""
    from megasparse.loss import cce_fused
    from megasparse.loss.cce_gemm import gemm_shard_backward, gemm_shard_forward

    n, v, pad, d = 1037, 50257, 15, 2304
    g = torch.Generator(device="cuda").manual_seed(7)
    h = torch.randn(n, d, device="cuda", generator=g).to(dtype)
    w = (torch.randn(v + pad, d, device="cuda", generator=g) * 2 / d**0.5).to(dtype)
    t = torch.randint(-1, v, (n,), device="cuda", generator=g)
    gs, gt = torch.rand(n, device="cuda", generator=g) + 0.5, torch.rand(n, device="cuda", generator=g) + 0.5
    if not cce_fused.usable(h, w):
        pytest.skip("fused passes need sm_90+")
    lse, tg = gemm_shard_forward(h, w, t, v, softcap, fused=False)
    f_lse, f_tg = gemm_shard_forward(h, w, t, v, softcap, fused=True)
    torch.testing.assert_close(f_lse, lse, rtol=0, atol=1e-4)
    torch.testing.assert_close(f_tg, tg, rtol=0, atol=1e-4)
    s_lse, s_tg = cce_fused.lse_pass(h, w, t.to(torch.int32), v, softcap, budget=n * 4 * 37)  # 37 tiles a launch
    torch.testing.assert_close(s_lse, lse, rtol=0, atol=1e-4)
    torch.testing.assert_close(s_tg, tg, rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="fused CCE logit passes need"):  # fp32 would run as TF32
        gemm_shard_forward(h.float(), w.float(), t, v, softcap, fused=True)
    d_e, d_c = gemm_shard_backward(h, w, t, lse, gs, gt, v, softcap, fused=False)
    f_e, f_c = gemm_shard_backward(h, w, t, lse, gs, gt, v, softcap, fused=True, chunk=3000)  # ragged chunks
    assert _rel(f_e, d_e) < 1e-2 and _rel(f_c, d_c) < 1e-2
    assert f_c[v:].eq(0).all()


def test_fused_backward_wave_width_matches_widest():
    """The P width ``wave_cols`` picks (narrower than the cap at the Llama-3-8B rows and hidden size) gives the
    gradients the widest P gives, to bf16 rounding of dE's per-chunk sums."""
    from megasparse.loss import cce_fused, cce_gemm

    n, v, d = 8192, 9000, 4096
    g = torch.Generator(device="cuda").manual_seed(11)
    h = torch.randn(n, d, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(v, d, device="cuda", generator=g) * 2 / d**0.5).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    ones = torch.ones(n, device="cuda")
    if not cce_fused.usable(h, w):
        pytest.skip("fused passes need sm_90+")
    sms = cce_fused.sm_count(h.device)
    lse, _ = cce_gemm.gemm_shard_forward(h, w, t, v)
    widest = cce_gemm.chunk_cols(n, v, 2, cce_gemm.P_BYTES, cce_fused.BWD.block_v)
    grads = {}
    for on in (True, False):
        cce_gemm.WAVE_WIDTH = on
        try:
            grads[on] = cce_gemm.gemm_shard_backward(h, w, t, lse, ones, ones, v)
            grads[on, "cols"] = cce_gemm.fused_p_cols(n, v, d, 2, sms)
        finally:
            cce_gemm.WAVE_WIDTH = True
    assert grads[False, "cols"] == widest and grads[True, "cols"] <= widest
    assert _rel(grads[True][0], grads[False][0]) < 1e-2
    assert torch.equal(grads[True][1], grads[False][1])  # dC: each vocabulary row's one GEMM, K = all rows, either way
    # loss.cce_scratch_mb: P as wide as the whole slice in one chunk, the same gradients to dE's rounding
    whole = n * 9216 * 2  # bytes of a P 9216 columns wide (a multiple of the tile), > v
    one = cce_gemm.gemm_shard_backward(h, w, t, lse, ones, ones, v, scratch=whole)
    assert cce_gemm.fused_p_cols(n, v, d, 2, sms, whole) == v > grads[True, "cols"]
    assert _rel(one[0], grads[True][0]) < 1e-2 and _rel(one[1], grads[True][1]) < 1e-3
