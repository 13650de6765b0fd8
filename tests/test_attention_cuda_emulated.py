"""The CUDA branches of the attention (``ops/attention.py``, ``ops/prefix_attention.py``) on CPU: the cuDNN, flash and
memory-efficient kernels emulated with the contracts the real ones hold callers to (``tests/cuda_emulation.py``), so
CPU CI runs the code a bf16 GPU run takes (kernel choice, lse layouts, GQA heads, the padded document bias) — here
through ChunkFlow's collider step against whole-sequence collider, with the tokens the CUDA generator selects.

Issue 30's bf16 collider case (0.996 off on an H100) passes this way: whatever breaks it on the GPU is inside a kernel
(``tests/test_gpu_chunkflow.py`` checks every kernel call of that run), not in the branches taken around them."""

from __future__ import annotations

import pytest
import torch
from cuda_emulation import EMULATED, _philox, cuda_uniform, emulated_kernels
from distributed import run_distributed
from test_chunkflow import _check_filtered, _compare_filtered


def _cuda_draws(scorer, loss, ref_loss=None, *, generator=None):
    """``filtering.selection.score_tokens``'s random scores as the CUDA generator draws them."""
    assert scorer == "random"
    return cuda_uniform(loss.numel(), generator.initial_seed())


@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
def test_bf16_collider_on_chunks_through_the_cuda_branches(monkeypatch, kernel: str) -> None:
    """cuDNN (documents with its bias), or flash with the memory-efficient kernel for documents (cuDNN refused): the
    chunked step's compact backwards (prefix and packed chunks, kept rows of 1 to 8) equal whole-sequence collider,
    and cuDNN never gets a sequence of length 1 (the emulation refuses it, as torch's dispatcher does)."""
    from megasparse.chunkflow import filter as chunk_filter
    from megasparse.ops import attention as attn

    counts = emulated_kernels(monkeypatch)
    monkeypatch.setitem(attn._CUDNN, "ok", kernel == "cudnn")
    monkeypatch.setattr(chunk_filter, "score_tokens", _cuda_draws)
    (res,) = run_distributed(_compare_filtered, 1, "random", "collider", (1,), True, ("train.dtype=bf16",))
    _check_filtered(res, tol=3e-2)
    ran = {n.removeprefix("_scaled_dot_product_") for n, c in counts.items() if c}
    if kernel == "cudnn":  # a call of one row (a kept row, a one-row tail) takes flash; cuDNN stays on for the rest
        assert ran == {"cudnn_attention", "cudnn_attention_backward", "flash_attention", "flash_attention_backward"}
        assert attn._CUDNN["ok"] and attn._CUDNN_BIAS["ok"]
    else:
        assert ran == {"flash_attention", "flash_attention_backward"} | {
            "efficient_attention",
            "efficient_attention_backward",
        }


def test_emulated_flash_reads_the_lse_as_contiguous() -> None:
    """The contract that broke an H100 run (decision 1230): a padded lse layout reaches flash's backward as wrong rows
    here too, so the emulation catches a caller that pads it."""
    torch.manual_seed(0)
    q, k, v, g = (torch.randn(1, 2, 5, 8, dtype=torch.float64) for _ in range(4))
    out, lse, *_ = EMULATED["_scaled_dot_product_flash_attention"](q, k, v, 0.0, True, False, scale=0.3)
    args = (None, None, 5, 5, 0.0, True, None, None)
    want = EMULATED["_scaled_dot_product_flash_attention_backward"](g, q, k, v, out, lse, *args, scale=0.3)
    padded = torch.zeros(1, 2, 32, dtype=lse.dtype)[..., :5].copy_(lse)
    got = EMULATED["_scaled_dot_product_flash_attention_backward"](g, q, k, v, out, padded, *args, scale=0.3)
    assert torch.allclose(got[2][:, 0], want[2][:, 0]) and not torch.allclose(got[0][:, 1], want[0][:, 1])


def test_cuda_uniform_is_philox() -> None:
    """Philox4x32-10's published known answers (Random123's kat_vectors), and draws in [0, 1)."""
    assert _philox((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    ones = (0xFFFFFFFF,) * 4
    assert _philox(ones, ones[:2]) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    pi = ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0))
    assert _philox(*pi) == (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)
    u = cuda_uniform(100, 1234)
    assert u.dtype == torch.float32 and 0 < u.min() and u.max() < 1 and len(set(u.tolist())) == 100
    # torch.rand(223, generator seeded 7, device="cuda") on an H200: curand rounds the 32-bit draw to float32 before
    # scaling it, so these three differ in the last bit from one rounding of the exact value (decision 1230)
    h200 = {97: 0.02411765232682228, 203: 0.056084044277668, 222: 0.06166298687458038}
    assert {i: cuda_uniform(223, 7)[i].item() for i in h200} == h200


@pytest.mark.parametrize("masked", [False, True])
def test_one_row_calls_leave_cudnn_for_flash_or_the_efficient_kernel(monkeypatch, masked: bool) -> None:
    """A compact backward of one kept row after a cuDNN forward: flash takes it (the efficient kernel under a
    document mask, with the lse re-laid in its padded rows), the gradients equal the fp64 ones, cuDNN stays on."""
    from cuda_emulation import attention_backward

    from megasparse.ops import attention as attn

    counts = emulated_kernels(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 6, 16, generator=gen).to(torch.bfloat16) for _ in range(3))
    bias = torch.zeros(1, 1, 6, 6).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    bias = bias.to(torch.bfloat16) if masked else None
    out, lse, rng = attn._flash_fwd(q, k, v, 0.25, bias)
    assert rng[0] == "cudnn"
    row = slice(2, 3)  # one kept row: it attends to itself only (its keys are the kept rows)
    g = torch.randn(1, 4, 1, 16, generator=gen).to(torch.bfloat16)
    one = None if bias is None else bias[..., row, row]
    got = attn._flash_bwd(g, q[:, :, row], k[:, :, row], v[:, :, row], out[:, :, row], lse[..., row], rng, 0.25, one)
    want = attention_backward(g, q[:, :, row], k[:, :, row], v[:, :, row], out[:, :, row], lse[..., row], 0.25,
                              bias is None, one)  # fmt: skip
    for a, b in zip(got, want):
        assert torch.allclose(a.double(), b, atol=2e-2, rtol=2e-2)
    assert counts["_scaled_dot_product_cudnn_attention_backward"] == 0
    other = "efficient_attention_backward" if masked else "flash_attention_backward"
    assert counts[f"_scaled_dot_product_{other}"] == 1 and attn._CUDNN["ok"] and attn._CUDNN_BIAS["ok"]
