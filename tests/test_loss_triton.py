"""Triton CCE kernels under TRITON_INTERPRET=1 (CPU) against an fp64 reference, small shapes.

The interpreter must be switched on before triton is imported, so the cases run in a fresh Python
process (this file run as a script); pytest only launches it and checks the verdict.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CASES = [
    # n, v (real), pad rows, h, softcap, z, filter_eps, sort
    (37, 300, 0, 48, None, 0.0, None, False),
    (37, 300, 5, 50, None, 0.0, None, False),  # h not a multiple of block_d, padded vocab
    (37, 300, 0, 48, 5.0, 1e-2, None, True),
    (29, 257, 3, 48, None, 0.0, 2.0**-12, True),
]


def _fp64_loss(h, w, t, v: int, sc, z: float = 0.0):
    """(per-token fp64 loss with ignore_index rows at 0, lse, h64, w64) of the first ``v`` rows of ``w``."""
    import torch

    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    lg = h64 @ w64[:v].T
    if sc:
        lg = sc * torch.tanh(lg / sc)
    lse = torch.logsumexp(lg, 1)
    valid = t != -100
    ref = torch.where(valid, lse - lg.gather(1, t.clamp(min=0)[:, None]).squeeze(1) + z * lse * lse, 0.0)
    return ref, lse, h64, w64


def _run_cases() -> None:
    import torch

    from megasparse.loss import LossConfig, vocab_parallel_loss
    from megasparse.loss.cce_launch import KernelConfig, triton_shard_backward, triton_shard_forward
    from megasparse.loss.reference import torch_shard_backward

    for i, (n, v, pad, d, sc, z, eps, srt) in enumerate(CASES):
        g = torch.Generator().manual_seed(100 + i)
        h = torch.randn(n, d, generator=g)
        w = torch.randn(v + pad, d, generator=g) / d**0.5 * 4
        t = torch.randint(0, v, (n,), generator=g)
        t[2] = -100
        gout = torch.rand(n, generator=g) + 0.5
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        cfg = LossConfig(impl="cce", softcap=sc, z_loss=z, filter_eps=eps, sort_vocab=srt, backend="triton")
        loss = vocab_parallel_loss(hh, ww, t, cfg, vocab_start=0, vocab_size=v)
        loss.backward(gout)
        ref, lse, h64, w64 = _fp64_loss(h, w, t, v, sc, z)
        valid = t != -100
        ref.backward(gout.double())
        tol = 1e-5 if eps is None else 5e-3
        for name, a, b in (("loss", loss, ref), ("dE", hh.grad, h64.grad), ("dC", ww.grad, w64.grad)):
            err = float((a.detach().double() - b).norm() / b.norm())
            assert err < tol, (i, name, err)
        assert torch.all(hh.grad[2] == 0) and torch.all(ww.grad[v:] == 0), i
        # the kernel's own tiling, several splits and tiles that straddle the row/vocab edges
        cfg_k = KernelConfig(16, 32, 16, 4, 1)
        tl = torch.where(valid, t, -1)
        lse_k, tgt_k = triton_shard_forward(h, w, tl, v, sc, cfg=cfg_k, splits=3)
        torch.testing.assert_close(lse_k.double(), lse.detach(), rtol=1e-5, atol=1e-5)
        d_e, _ = triton_shard_backward(h, w, tl, lse_k, gout, gout, v, sc, None, None, cfg=cfg_k)
        d_e2, _ = triton_shard_backward(h, w, tl, lse_k, gout, gout, v, sc, None, None, cfg=cfg_k)
        assert torch.equal(d_e, d_e2), "interpreted exact mode must be deterministic"
        d_e3, _ = triton_shard_backward(h, w, tl, lse_k, gout, gout, v, sc, None, None, accum_fp32=True, cfg=cfg_k)
        torch.testing.assert_close(d_e3, d_e, rtol=1e-5, atol=1e-6)
        # eps above any probability skips every tile: only the row-owned one-hot pass adds anything
        d_e, d_c = triton_shard_backward(h, w, tl, lse_k, gout, gout, v, sc, 1.01, None, cfg=cfg_k)
        r_e, r_c = torch_shard_backward(h, w, tl, lse_k, gout, gout, v, sc, 1.01, None)
        torch.testing.assert_close(d_e, r_e, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(d_c, r_c, rtol=1e-5, atol=1e-6)
        assert d_e[valid].abs().sum(1).gt(0).all() and d_e[~valid].eq(0).all()
        print(f"case {i} ok")
    import megasparse.loss.cce_gemm as cce_gemm

    for fp32 in (False, True):  # S in the input dtype (P overwrites it) and S in fp32 (P in its own buffer)
        cce_gemm.LOGITS_FP32 = fp32
        _run_gemm_cases()
    print("ALL OK")


def _check_wave_cols() -> None:
    """The fused backward's P width: under the cap, at least half of it, whole tiles; waves decide (decision 0205)."""
    from megasparse.loss.cce_gemm import wave_cols

    # Llama-3-8B at 8192 rows on 132 SMs: dC at 3584 columns is 448 tiles (4 waves, the last 40% full), 3072 is 384
    assert wave_cols(8192, 128256, 4096, 3584, 132) == 3072
    assert wave_cols(8192, 128256, 4096, 3584, 112) == 3584  # 448 tiles are exactly 4 waves on 112 SMs
    assert wave_cols(8192, 256000, 2304, 3584, 132) == 3584  # Gemma-2: dC at 3584 is 252 tiles, 1.9 waves
    assert wave_cols(4096, 128256, 4096, 7168, 132) == 7168
    assert wave_cols(8192, 3000, 4096, 3584, 132) == 3584  # one chunk holds the slice: the cap
    cases = ((1037, 50257, 2304, 28160, 132), (300, 10**6, 512, 97792, 78), (8192, 64128, 4096, 3584, 148))
    for n, v, d, cap, sms in cases:
        c = wave_cols(n, v, d, cap, sms)
        assert c % 256 == 0 and cap // 2 <= c <= cap, (n, v, d, cap, sms, c)


def _run_gemm_cases() -> None:
    """The GEMM backend (cce_gemm.py): several chunks with a ragged last one, softcap, targets outside the slice,
    ignored rows and TP padding rows, against the chunked reference and an fp64 loss."""
    import torch

    from megasparse.loss import LossConfig, cce_gemm, vocab_parallel_loss
    from megasparse.loss.cce_gemm import backward_chunks, chunk_cols, gemm_shard_backward, gemm_shard_forward
    from megasparse.loss.reference import torch_shard_backward, torch_shard_forward

    assert chunk_cols(8192, 128256, 4) == 1536 and chunk_cols(10**6, 5000, 2) == 256 and chunk_cols(3, 300, 2) == 300
    assert backward_chunks(8192, 128256, 2, 4) == (512, 2048) and backward_chunks(8192, 128256, 2, 2) == (3072, 3072)
    mib = 2**20  # loss.cce_scratch_mb: wider chunks under a larger bound, within it
    assert backward_chunks(8192, 128256, 2, 4, 96 * mib) == (1024, 4096)
    assert backward_chunks(8192, 128256, 2, 2, 96 * mib) == (6144, 6144)
    assert cce_gemm.fused_p_cols(8192, 128256, 4096, 2, 132) == 3072
    for mb, lo in ((112, 3584), (224, 7168), (448, 14336)):
        c = cce_gemm.fused_p_cols(8192, 128256, 4096, 2, 132, mb * mib)
        assert lo <= c and 8192 * c * 2 <= mb * mib, (mb, c)
    _check_wave_cols()
    for i, (n, v, pad, d, sc) in enumerate(((37, 300, 3, 48, None), (53, 261, 0, 40, 5.0))):
        g = torch.Generator().manual_seed(200 + i)
        h = torch.randn(n, d, generator=g)
        w = torch.randn(v + pad, d, generator=g) / d**0.5 * 4
        t = torch.randint(-1, v, (n,), generator=g)  # -1: the target lives in another slice
        gs, gt = torch.rand(n, generator=g) + 0.5, torch.rand(n, generator=g) + 0.5
        gs[3] = gt[3] = 0.0  # an ignored row: zero gradient, no dropping
        lse, tg = gemm_shard_forward(h, w, t, v, sc, chunk=128)
        r_lse, r_tg = torch_shard_forward(h, w, t, v, sc)
        torch.testing.assert_close(lse, r_lse, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tg, r_tg, rtol=1e-5, atol=1e-5)
        r_e, r_c = torch_shard_backward(h, w, t, lse, gs, gt, v, sc)
        for chunk, sub in ((128, None), (128, 48)):  # P of 128 columns from S sub-chunks of 48 (a ragged last one)
            d_e, d_c = gemm_shard_backward(h, w, t, lse, gs, gt, v, sc, chunk=chunk, sub=sub)
            torch.testing.assert_close(d_e, r_e, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(d_c, r_c, rtol=1e-5, atol=1e-5)
        assert d_e[3].eq(0).all() and d_c[v:].eq(0).all()
        # dC added into an fp32 bucket slice by the chunks' GEMMs: prior contents kept, padding rows untouched
        prior = torch.randn(w.shape, generator=g)
        bucket = prior.clone()
        d_e_b, none = gemm_shard_backward(h, w, t, lse, gs, gt, v, sc, chunk=128, sub=48, dc_out=bucket)
        assert none is None and torch.equal(d_e_b, d_e) and torch.equal(bucket[v:], prior[v:])
        torch.testing.assert_close(bucket - prior, r_c, rtol=1e-5, atol=1e-5)
        d_e32, _ = gemm_shard_backward(h, w, t, lse, gs, gt, v, sc, accum_fp32=True, chunk=128)
        torch.testing.assert_close(d_e32, r_e, rtol=1e-5, atol=1e-5)
        # through the loss: ignore_index rows get loss 0 and zero dE, against fp64
        t2 = t.clamp(min=0)
        t2[5] = -100
        gout = torch.rand(n, generator=g) + 0.5
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        cfg = LossConfig(impl="cce", softcap=sc, backend="gemm")
        loss = vocab_parallel_loss(hh, ww, t2, cfg, vocab_start=0, vocab_size=v)
        loss.backward(gout)
        ref, _, h64, w64 = _fp64_loss(h, w, t2, v, sc)
        ref.backward(gout.double())
        for name, a, b in (("loss", loss, ref), ("dE", hh.grad, h64.grad), ("dC", ww.grad, w64.grad)):
            err = float((a.detach().double() - b).norm() / b.norm())
            assert err < 1e-5, ("gemm", i, name, err)
        assert hh.grad[5].eq(0).all() and ww.grad[v:].eq(0).all()
        if cce_gemm.LOGITS_FP32:  # the fused passes have no S: once is enough
            _check_fused(h, w, t, v, sc, gs, gt, lse, r_lse, r_tg, r_e, r_c)
        print(f"gemm case {i} ok")


def _check_fused(h, w, t, v, sc, gs, gt, lse, r_lse, r_tg, r_e, r_c) -> None:
    """The fused logit passes (cce_fused.py, TMA descriptors): through the backend at its own tiling, and directly at
    a small tiling with several row groups, a ragged last tile and a forward split over vocabulary launches."""
    import torch

    from megasparse.loss import cce_fused
    from megasparse.loss.cce_gemm import gemm_shard_backward, gemm_shard_forward
    from megasparse.loss.cce_kernels import KernelConfig

    for chunk in (None, 100):  # one launch; launches of one 256-column tile each
        f_lse, f_tg = gemm_shard_forward(h, w, t, v, sc, chunk=chunk, fused=True)
        torch.testing.assert_close(f_lse, r_lse, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(f_tg, r_tg, rtol=1e-5, atol=1e-5)
    for chunk in (None, 128):  # one P chunk; P chunks narrower than a tile with a ragged last one
        d_e, d_c = gemm_shard_backward(h, w, t, lse, gs, gt, v, sc, chunk=chunk, fused=True)
        torch.testing.assert_close(d_e, r_e, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(d_c, r_c, rtol=1e-5, atol=1e-5)
    small = KernelConfig(block_m=16, block_v=32, block_d=16, num_warps=4, num_stages=1, group_m=2)
    t32 = t.to(torch.int32)
    for budget in (4 * h.shape[0], 3 * 4 * h.shape[0], 2**20):  # 1 or 3 tiles per launch, or all in one
        s_lse, s_tg = cce_fused.lse_pass(h, w, t32, v, sc, budget, small)
        torch.testing.assert_close(s_lse, r_lse, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s_tg, r_tg, rtol=1e-5, atol=1e-5)
    logits = h.double() @ w[70:170].double().T
    th = torch.tanh(logits / sc) if sc else None
    x = sc * th if sc else logits
    ref = gs.double()[:, None] * torch.exp(x - lse.double()[:, None])
    ref -= gt.double()[:, None] * torch.nn.functional.one_hot((t - 70).clamp(0, 100), 101)[:, :100] * (t >= 70)[:, None]
    if sc:
        ref *= 1 - th * th
    small_ws = dataclasses.replace(small, flatten=True, warp_specialize=True)
    for cfg in (small, small_ws):  # the shipped P pass has a plain tile loop; the flattened one must agree too
        p = torch.full((h.shape[0], 100), float("nan"))  # every entry must be written
        cce_fused.grad_pass(cce_fused.Descriptors(h, w, cfg), t32, lse, gs.float(), gt.float(), 70, p, sc)
        torch.testing.assert_close(p.double(), ref, rtol=1e-5, atol=1e-5)


def test_triton_kernels_interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ALL OK" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    _run_cases()
