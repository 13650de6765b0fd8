"""A faster loss must not be a worse gradient (issue 33 item 6, decision 0207).

The default CCE backward (the GEMM backend, what CUDA runs) over a vocabulary of many chunks, in bf16, after a final
RMSNorm: its dE, dC and the norm weight's gradient against an fp64 reference and against the materialised bf16 loss
(``loss.impl=materialized``). Before decision 0207 the running dE was rounded to bf16 once per chunk, which at 32
chunks put the norm weight's gradient several times further from fp64 than the materialised loss's. The GEMM
backend's softmax kernels run under TRITON_INTERPRET=1 in a fresh process (``interpret.py``); the chunk bound is
shrunk so a small vocabulary spans many chunks.
"""

from __future__ import annotations

import torch
from interpret import check_under_interpreter, needs_interpreter

from megasparse.loss import LossConfig
from megasparse.loss.core import loss_options

N, D, V, CHUNK = 384, 64, 8192, 256  # 32 vocabulary chunks
SPREAD = 1.1
"""Two losses that both round dE once differ by a few % in error at this size; once per chunk is ~3× (dE)."""


def _inputs():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    gamma = (1 + 0.1 * torch.randn(D, generator=g, dtype=torch.float64)).bfloat16().double()
    w = (torch.randn(V, D, generator=g) * 2 / D**0.5).bfloat16()
    t = torch.randint(0, V, (N,), generator=g)
    gout = torch.rand(N, generator=g, dtype=torch.float64) + 0.5
    return x, gamma, w, t, gout


def _grads(cfg: LossConfig | None, x, gamma, w, t, gout) -> dict[str, torch.Tensor]:
    """dE (into the norm's output), dC and the norm weight's gradient; ``cfg`` None: the fp64 reference."""
    from megasparse.loss import vocab_parallel_loss

    gm = gamma.clone().requires_grad_()
    xhat = x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-5)
    if cfg is None:
        h = (xhat * gm).requires_grad_()
        h.retain_grad()
        ww = w.double().requires_grad_()
        lg = h @ ww.T
        loss = torch.logsumexp(lg, 1) - lg.gather(1, t[:, None]).squeeze(1)
    else:  # the norm's output rounded to bf16, as the model hands it to the loss
        h = (xhat * gm).bfloat16()
        h.retain_grad()
        ww = w.clone().requires_grad_()
        loss = vocab_parallel_loss(h, ww, t, cfg, vocab_start=0, vocab_size=V).double()
    loss.backward(gout)
    return {"dE": h.grad.double(), "dC": ww.grad.double(), "norm": gm.grad.double()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _round_like_the_gpu() -> None:
    """The interpreter casts fp32 to bf16 by truncation; compiled Triton (and torch) round to nearest even. Without
    this, the interpreted P carries a bias the GPU's does not and every interpreted bf16 gradient looks worse."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    truncating = interpreter._convert_float

    def convert(x, src, dst, rounding):
        if src == tl.float32 and dst == tl.bfloat16:
            t = torch.from_numpy(np.ascontiguousarray(x).view(np.float32)).bfloat16()
            return t.view(torch.int16).numpy().view(np.uint16).reshape(x.shape)
        return truncating(x, src, dst, rounding)

    interpreter._convert_float = convert


def _check() -> None:
    """Run under the interpreter: the GEMM backend (fused off: no sm_90 here) over CHUNK-column chunks."""
    from megasparse.loss import cce_gemm

    _round_like_the_gpu()

    cce_gemm.CHUNK_BYTES = N * CHUNK * (4 + 2)  # S (fp32) and P (bf16) chunks of CHUNK columns
    cce_gemm.P_PER_S = 1
    cce_gemm._blocks = lambda h, kind: (128, CHUNK)  # fewer, larger interpreted programs: same maths
    assert cce_gemm.backward_chunks(N, V, 2, 4) == (CHUNK, CHUNK)
    inputs = _inputs()
    ref = _grads(None, *inputs)
    mat = _grads(LossConfig(impl="materialized"), *inputs)
    got = _grads(LossConfig(impl="cce", backend="gemm"), *inputs)  # the backend CUDA runs by default
    worse = []
    for k in ref:
        e_got, e_mat = _rel(got[k], ref[k]), _rel(mat[k], ref[k])
        print(f"{k}: default {e_got:.3e} materialised {e_mat:.3e}")
        if e_got > SPREAD * e_mat:
            worse.append(f"{k}: default loss {e_got:.3e} vs fp64, materialised bf16 {e_mat:.3e}")
    assert not worse, worse


@needs_interpreter
def test_default_cce_gradients_as_accurate_as_materialised():
    check_under_interpreter("test_loss_accuracy")


def test_fp32_de_accumulation_is_the_default_everywhere():
    """The TP loss and the vocab-over-PP slices take ``accum_fp32`` from the one config default."""
    from megasparse.loss.pipeline import _Slice

    cfg = LossConfig(impl="cce")
    assert loss_options(cfg, "cce", torch.bfloat16, 100, 0, -100, False).accum_fp32
    assert _Slice(cfg, 0, 100, 100, torch.bfloat16, -100, 64).opt.accum_fp32
