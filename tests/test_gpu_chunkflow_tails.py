"""ChunkFlow's last chunk with packed short documents (decision 1233) on CUDA: the prefix attention with a document
mask and the prefix seen by the tail's rows only (cuDNN bf16 with a mask bias, the memory-efficient kernel beside
flash for the prefix when cuDNN is off, fp32) against the fp64 reference, dense and Collider's compact backward;
the same chunk on FlexAttention (decision 1239: one compiled flex call over prefix ++ own keys, flex's backward)
against the bias kernels and fp64; and the packed chunked step against whole sequences (fp32, the dense and the
collider one; the dense one on flex too)."""

from __future__ import annotations

import pytest
import torch
from test_gpu_chunkflow import _rel, _Source

from megasparse.ops import attention as attn
from megasparse.ops.attention import rope_tables
from megasparse.ops.documents import DocSpans
from megasparse.ops.prefix_attention import prefix_attention, prefix_attention_reference

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def _tail_docs(prefix: int, pieces: list[int], s: int, kernel: str = "bias") -> DocSpans:
    """Piece 0 the tail (positions from ``prefix``), the others documents from 0, the rest one padding document."""
    seg, pos = [], []
    for i, n in enumerate(pieces + [s - sum(pieces)]):
        seg += [i] * n
        pos += [(prefix if i == 0 else 0) + t for t in range(n)]
    to = {"device": "cuda"}
    return DocSpans(torch.tensor(seg, **to).view(-1, 1), torch.tensor(pos, **to).view(-1, 1), kernel)


@pytest.mark.parametrize(
    ("dtype", "cudnn", "tol"),
    [(torch.bfloat16, True, 2e-2), (torch.bfloat16, False, 2e-2), (torch.float32, True, 1e-4)],
    ids=["bf16-cudnn", "bf16-efficient+flash", "fp32-efficient"],
)
@pytest.mark.parametrize("compact", [False, True], ids=["dense", "collider"])
def test_packed_last_chunk_prefix_attention_matches_fp64(monkeypatch, dtype, cudnn: bool, tol: float, compact: bool):
    monkeypatch.setitem(attn._CUDNN, "ok", cudnn)
    torch.manual_seed(5)
    s, prefix, nq, nkv, d, pieces = 200, 328, 8, 2, 64, [77, 50, 40, 20]
    head = pieces[0]
    docs = _tail_docs(prefix, pieces, s)
    cos, sin = rope_tables(prefix + s, d, 10000.0, "cuda")
    qkv = torch.randn(s, 1, (nq + 2 * nkv) * d, device="cuda", dtype=dtype, requires_grad=True)
    kp, vp = (torch.randn(1, nkv, prefix, d, device="cuda", dtype=dtype) for _ in range(2))
    keep = torch.rand(prefix + s, device="cuda") < (0.5 if compact else 2.0)
    keep[prefix] = keep[prefix + head] = True
    own = keep[prefix:].nonzero()[:, 0]
    src = _Source(kp, vp, keep[:prefix].nonzero()[:, 0] if compact else None)
    y, _, _ = prefix_attention(qkv, nq, nkv, cos, sin, prefix, src, None, docs, head)
    gy = torch.randn_like(y) * keep[prefix:, None, None]
    if compact:
        from megasparse.ops.compact import CompactGrad, KeepMeta

        y.backward(CompactGrad(gy.view(s, -1)[own], KeepMeta(own, s), y.shape))
    else:
        y.backward(gy)
    x = qkv.detach().double().requires_grad_()
    k64, v64 = kp.double().requires_grad_(), vp.double().requires_grad_()
    c64, s64 = cos.double(), sin.double()
    ref = prefix_attention_reference(
        x, nq, nkv, c64, s64, prefix, k64, v64, None, keep if compact else None, docs, head
    )
    ref[0].backward(gy.double())
    assert _rel(y, ref[0]) < tol
    got = qkv.grad.rows if compact else qkv.grad.view(s, -1)
    assert _rel(got, x.grad.view(s, -1)[own]) < tol
    at = src.rows if compact else slice(None)
    assert _rel(src.got[0], k64.grad[:, :, at]) < tol and _rel(src.got[1], v64.grad[:, :, at]) < tol


def _packed_tail_run(kernel: str, dtype: torch.dtype, seed: int = 7, width: int | None = None):
    """One packed last chunk (640 rows: a 300-row tail, documents of 77, 1, 150 and 90 rows, padding) over a
    1280-row prefix through ``prefix_attention`` on ``kernel``: (y, dqkv, dk_prefix, dv_prefix), the fp64
    reference's, and the chunk's spans. ``width``: flex's keys padded to it (decision 1248)."""
    torch.manual_seed(seed)
    s, prefix, nq, nkv, d, pieces = 640, 1280, 8, 2, 128, [300, 77, 1, 150, 90]
    docs = _tail_docs(prefix, pieces, s, kernel)
    cos, sin = rope_tables(prefix + s, d, 500000.0, "cuda")
    qkv = torch.randn(s, 1, (nq + 2 * nkv) * d, device="cuda", dtype=dtype, requires_grad=True)
    kp, vp = (torch.randn(1, nkv, prefix, d, device="cuda", dtype=dtype) for _ in range(2))
    src = _Source(kp, vp)
    y, _, _ = prefix_attention(qkv, nq, nkv, cos, sin, prefix, src, None, docs, pieces[0], width)
    gy = torch.randn_like(y)
    y.backward(gy)
    x, k64, v64 = (t.detach().double().requires_grad_() for t in (qkv, kp, vp))
    ref = prefix_attention_reference(x, nq, nkv, cos.double(), sin.double(), prefix, k64, v64, None, None, docs,
                                     pieces[0])  # fmt: skip
    ref[0].backward(gy.double())
    return (y, qkv.grad, *src.got), (ref[0], x.grad, k64.grad, v64.grad), docs


@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)], ids=["bf16", "fp32"])
@pytest.mark.parametrize("width", [None, 2560], ids=["exact", "padded"])
def test_packed_last_chunk_on_flex_equals_the_bias_kernels(dtype, tol: float, width: int | None):
    """Forward and every gradient (q/k/v through the input rows, the prefix's keys and values) of the flex path
    against the bias kernels' path on the same inputs and against fp64; flex ran (its mask, no bias built) and did
    not fall back. ``padded``: the keys padded from 1920 to 2560 (five empty tiles; ChunkFlow's route)."""
    from megasparse.ops import doc_flex

    flex, ref, docs = _packed_tail_run("flex", dtype, width=width)
    bias, _, bias_docs = _packed_tail_run("bias", dtype)
    assert doc_flex._OK["ok"], "a flex call failed: the bias kernels ran"
    assert any(isinstance(k, tuple) and k[0] == "tail_flex_mask" for k in docs._cache)
    assert not any(isinstance(k, tuple) and k[0] == "bias" for k in docs._cache)
    assert any(isinstance(k, tuple) and k[0] == "bias" for k in bias_docs._cache)
    for name, a, b, r in zip(("y", "dqkv", "dk_prefix", "dv_prefix"), flex, bias, ref):
        assert _rel(a, r) < tol and _rel(b, r) < tol and _rel(a, b.double()) < tol, (name, _rel(a, r), _rel(b, r))


def test_packed_tail_chunked_step_matches_whole_sequences_on_cuda():
    """The dense step (K = 1: the long sequence's earlier chunks rerun) and collider (K = 1 and 4), fp32."""
    from distributed import run_distributed
    from test_chunkflow import _check_filtered, _compare_filtered, _compare_packed

    gpu = ("train.device=cuda", "train.dtype=fp32", "parallel.backend=nccl")
    ((tok, grad, chunks, tail),) = run_distributed(_compare_packed, 1, "bias", gpu)
    assert chunks == 8 and tail == 3 and tok < 1e-4 and grad < 1e-4, (tok, grad)
    (res,) = run_distributed(_compare_filtered, 1, "random", "collider", (1, 4), True, gpu)
    _check_filtered(res, tol=1e-4)


def test_packed_tail_chunked_step_on_flex_matches_whole_sequences_on_cuda():
    """The dense step with ``data.document_attention_kernel=flex`` (fp32): the packed chunks and the long sequence's
    packed last chunk compile and run flex, forward and backward (decision 1239)."""
    from distributed import run_distributed
    from test_chunkflow import _compare_packed

    from megasparse.ops import doc_flex

    gpu = ("train.device=cuda", "train.dtype=fp32", "parallel.backend=nccl")
    ((tok, grad, chunks, tail),) = run_distributed(_compare_packed, 1, "flex", gpu)
    assert doc_flex._OK["ok"], "a flex call failed: the bias kernels ran"
    assert chunks == 8 and tail == 3 and tok < 1e-4 and grad < 1e-4, (tok, grad)
