"""The CUDA attention kernels ``ops/attention.py`` calls (cuDNN, flash, memory-efficient), emulated on CPU in fp64 with
the contracts the real ones hold callers to, and the CUDA generator's uniform draws; used three ways:

* ``emulated_kernels(monkeypatch)``: the CUDA branches of ``ops/attention.py`` and ``ops/prefix_attention.py`` (which
  kernel, the lse layouts, GQA heads, the document bias's padded rows) run on CPU tensors, so CPU CI covers them;
* ``checked_kernels(monkeypatch)`` on a GPU: every real kernel call is recomputed here from its own inputs and the
  worst disagreement per call is recorded (a kernel that is wrong at some shape names itself);
* ``cuda_uniform``: what ``torch.rand(n, generator=g, device="cuda")`` draws after ``g.manual_seed(seed)`` (curand's
  Philox4x32-10 as torch's uniform kernel uses it), so a CPU run can select the tokens a GPU run selects.

Contracts emulated (each one broke a GPU run once or is documented by torch): cuDNN refuses a sequence of length 1
(torch's dispatcher never sends one: pytorch#138531), takes GQA's key/value heads as they are, a [b, h, s, 1] lse
and a causal mask from the top-left; flash wants equal head counts, returns a contiguous [b, h, s] lse and reads the
lse back as contiguous whatever its strides (measured on an H100), and aligns a causal mask bottom-right; the
memory-efficient kernel pads its lse rows to 32 and refuses an lse whose head stride is not a multiple of 32.
Outputs are laid out like the real kernels' (cuDNN's like q, flash's and efficient's [b, s, h, d]).
"""

from __future__ import annotations

import numpy as np
import torch

_MASK32 = 0xFFFFFFFF


# -- the maths (fp64) ------------------------------------------------------------------------------------------------
def _scores(q, k, v, scale, causal, bias, bottom_right):
    """(scores with the masks applied, k and v repeated to q's heads), all fp64 on CPU."""
    q, k, v = (t.detach().double().cpu() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.detach().double().cpu()
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        shift = sk - sq if bottom_right else 0
        s = s.masked_fill(torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + shift, float("-inf"))
    return q, k, v, s


def attention_forward(q, k, v, scale, causal=True, bias=None, bottom_right=False):
    """(out [b, h, s, d], lse [b, h, s]) fp64."""
    _, _, v64, s = _scores(q, k, v, scale, causal, bias, bottom_right)
    return torch.softmax(s, -1) @ v64, torch.logsumexp(s, -1)


def attention_backward(g, q, k, v, out, lse, scale, causal=True, bias=None, bottom_right=False):
    """(dq, dk, dv) fp64 as the kernels compute them: probabilities from the *given* lse, D from the *given* out (the
    prefix attention hands each part the merged out and lse), dk/dv summed over each GQA group."""
    q64, k64, v64, s = _scores(q, k, v, scale, causal, bias, bottom_right)
    p = torch.exp(s - lse.detach().double().cpu()[..., None])
    g64 = g.detach().double().cpu()
    ds = p * (g64 @ v64.transpose(-1, -2) - (g64 * out.detach().double().cpu()).sum(-1, keepdim=True))
    dq, dk, dv = ds @ k64 * scale, ds.transpose(-1, -2) @ q64 * scale, p.transpose(-1, -2) @ g64
    nkv = k.shape[1]
    return dq, dk.unflatten(1, (nkv, -1)).sum(2), dv.unflatten(1, (nkv, -1)).sum(2)


# -- the kernels' contracts --------------------------------------------------------------------------------------------
def _like(t: torch.Tensor, shape, dtype) -> torch.Tensor:
    """A tensor of ``shape`` with ``t``'s dimension order in memory (torch's alloc_with_matching_layout)."""
    order = sorted(range(t.dim()), key=lambda i: -t.stride(i))
    return torch.empty([shape[i] for i in order], dtype=dtype).permute([order.index(i) for i in range(t.dim())])


def _bshd(b, h, s, d, dtype) -> torch.Tensor:
    return torch.empty(b, s, h, d, dtype=dtype).transpose(1, 2)


def _rng() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)


def _cudnn_lengths(q, k) -> None:
    if q.shape[2] < 2 or k.shape[2] < 2:  # torch's dispatcher never sends these to cuDNN (pytorch#138531)
        raise RuntimeError(f"cuDNN attention given a sequence of length {min(q.shape[2], k.shape[2])} (< 2)")


def cudnn_fwd(q, k, v, bias, compute_lse, dropout_p, is_causal, debug, scale=None):
    _cudnn_lengths(q, k)
    out, lse = attention_forward(q, k, v, scale, is_causal, bias)
    o = _like(q, out.shape, q.dtype).copy_(out)
    return (o, lse.float().unsqueeze(-1).contiguous(), None, None, q.shape[2], k.shape[2], *_rng(), None)


def cudnn_bwd(g, q, k, v, out, lse, seed, offset, bias, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, scale=None):
    _cudnn_lengths(q, k)
    if tuple(lse.shape) != (*q.shape[:3], 1):
        raise RuntimeError(f"cuDNN backward: lse of shape {tuple(lse.shape)}, wants {(*q.shape[:3], 1)}")
    if g.stride(-1) != 1:
        raise RuntimeError("cuDNN backward: grad_out's innermost stride must be 1")
    grads = attention_backward(g, q, k, v, out, lse[..., 0], scale, is_causal, bias)
    return tuple(gr.to(t.dtype) for gr, t in zip(grads, (q, k, v)))


def flash_fwd(q, k, v, dropout_p, is_causal, debug, scale=None):
    if k.shape[1] != q.shape[1]:
        raise RuntimeError("flash: key/value heads must equal query heads here (the caller expands GQA)")
    out, lse = attention_forward(q, k, v, scale, is_causal, bottom_right=True)
    o = _bshd(q.shape[0], q.shape[1], q.shape[2], v.shape[3], q.dtype).copy_(out)
    return (o, lse.float().contiguous(), None, None, q.shape[2], k.shape[2], *_rng(), None)


def flash_bwd(g, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, scale=None):
    packed = torch.empty(lse.shape).stride()
    lse = torch.as_strided(lse, lse.shape, packed, lse.storage_offset())  # flash reads it as contiguous
    grads = attention_backward(g, q, k, v, out, lse, scale, is_causal, bottom_right=True)
    return tuple(gr.to(t.dtype) for gr, t in zip(grads, (q, k, v)))


def efficient_fwd(q, k, v, bias, compute_lse, dropout_p, is_causal, scale=None):
    out, lse = attention_forward(q, k, v, scale, is_causal, bias)
    o = _bshd(q.shape[0], q.shape[1], q.shape[2], v.shape[3], q.dtype).copy_(out)
    padded = torch.full((*q.shape[:2], -(-q.shape[2] // 32) * 32), float("inf"))
    padded[..., : q.shape[2]] = lse
    return (o, padded, *_rng())


def efficient_bwd(g, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_mask, is_causal, scale=None):
    if lse.stride(1) % 32:
        raise RuntimeError(f"memory-efficient backward: lse head stride {lse.stride(1)} is not a multiple of 32")
    grads = attention_backward(g, q, k, v, out, lse[..., : q.shape[2]], scale, is_causal, bias)
    return (*(gr.to(t.dtype) for gr, t in zip(grads, (q, k, v))), None)


EMULATED = {
    "_scaled_dot_product_cudnn_attention": cudnn_fwd,
    "_scaled_dot_product_cudnn_attention_backward": cudnn_bwd,
    "_scaled_dot_product_flash_attention": flash_fwd,
    "_scaled_dot_product_flash_attention_backward": flash_bwd,
    "_scaled_dot_product_efficient_attention": efficient_fwd,
    "_scaled_dot_product_efficient_attention_backward": efficient_bwd,
}


_ARGS = {  # positions of (attn_bias, is_causal) in each op's arguments
    "_scaled_dot_product_cudnn_attention": (3, 6),
    "_scaled_dot_product_cudnn_attention_backward": (8, 14),
    "_scaled_dot_product_flash_attention": (None, 4),
    "_scaled_dot_product_flash_attention_backward": (None, 11),
    "_scaled_dot_product_efficient_attention": (3, 6),
    "_scaled_dot_product_efficient_attention_backward": (4, 11),
}


class _Namespace:
    """``torch.ops.aten`` with some ops replaced."""

    def __init__(self, ops: dict):
        self._ops = ops

    def __getattr__(self, name):
        return self._ops.get(name) or getattr(torch.ops.aten, name)


def emulated_kernels(monkeypatch) -> dict[str, int]:
    """CPU tensors take ``ops/attention.py``'s CUDA branches, on the emulated kernels; returns the calls per op."""
    from megasparse.ops import attention as attn

    counts = dict.fromkeys(EMULATED, 0)

    def counted(name, fn):
        def run(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(attn, "_ATEN", _Namespace({n: counted(n, f) for n, f in EMULATED.items()}))
    monkeypatch.setattr(attn, "_on_gpu", lambda t: True)
    return counts


# -- checking a GPU run's calls ----------------------------------------------------------------------------------------
def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-30) -> float:
    """|a − b| / |b| (|b| at least ``floor``), over every element."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(max(floor, 1e-30))) if b.numel() else 0.0


def checked_kernels(monkeypatch, real: dict | None = None) -> list[dict]:
    """Every attention kernel call of ``ops/attention.py`` (the real kernels, or ``real``'s) is recomputed by the maths
    above from its own inputs; returns the list each call appends to: {op, q, k, causal, bias, rel (worst output)}."""
    from megasparse.ops import attention as attn

    calls: list[dict] = []

    def check(name, real, emulated):
        bias_at, causal_at = _ARGS[name]

        def run(*args, **kwargs):
            got = real(*args, **kwargs)
            backward = name.endswith("_backward")
            q, k = args[1:3] if backward else args[:2]
            call = dict(op=name, q=tuple(q.shape), k=tuple(k.shape), causal=args[causal_at],
                        bias=bias_at is not None and args[bias_at] is not None)  # fmt: skip
            try:  # never raise into the caller: ops/attention.py turns a kernel off on a RuntimeError
                want = emulated(*args, **kwargs)
                if backward:  # a gradient that is 0 in exact maths (one key: dq = dk = 0) is judged on dv's scale
                    floor = 1e-2 * max(float(w.double().norm()) for w in want[:3])
                    call["rel"] = max(_rel(a, b, floor) for a, b in zip(got[:3], want[:3]))
                else:  # out, and the lse rows of the queries (the memory-efficient kernel pads its lse)
                    rows = lambda t: t.reshape(*q.shape[:2], -1)[..., : q.shape[2]]  # noqa: E731
                    call["rel"] = max(_rel(got[0], want[0]), _rel(rows(got[1]), rows(want[1])))
            except Exception as e:  # noqa: BLE001 - recorded as a failed call
                call.update(rel=float("inf"), error=f"{type(e).__name__}: {e}")
            calls.append(call)
            return got

        return run

    ops = {n: check(n, (real or {}).get(n) or getattr(torch.ops.aten, n), f) for n, f in EMULATED.items()}
    monkeypatch.setattr(attn, "_ATEN", _Namespace(ops))
    return calls


# -- the CUDA generator ------------------------------------------------------------------------------------------------
def _philox(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    """Philox4x32-10 (Salmon et al., 2011; curand's engine): ten rounds of two 32-bit multiplies."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & _MASK32, p1 & _MASK32, ((p0 >> 32) ^ c3 ^ k1) & _MASK32, p0 & _MASK32
        k0, k1 = (k0 + 0x9E3779B9) & _MASK32, (k1 + 0xBB67AE85) & _MASK32
    return c0, c1, c2, c3


def cuda_uniform(n: int, seed: int) -> torch.Tensor:
    """``torch.rand(n, generator=g, device="cuda")`` for a generator just seeded with ``seed``, on CPU: element i (for
    n up to the launch's thread count) is thread i's first ``curand_uniform4`` draw's x, counter (0, 0, i, 0).
    curand rounds twice, as float32 arithmetic does: the 32-bit draw to float32 first, then ``· 2⁻³² + 2⁻³³``
    (one rounding of the exact value instead differs in the last bit for about 1 draw in 100, seen on an H200)."""
    key = (seed & _MASK32, (seed >> 32) & _MASK32)
    out = np.empty(n, dtype=np.float32)
    scale, half = np.float32(2.0**-32), np.float32(2.0**-33)
    for i in range(n):
        x = np.float32(_philox((0, 0, i & _MASK32, i >> 32), key)[0]) * scale + half
        out[i] = 0.0 if x == 1.0 else x
    return torch.from_numpy(out)


def checked_ops(monkeypatch, calls: list[dict]) -> None:
    """The other GPU-only kernels of a bf16 layer, each call recomputed by its reference and appended to ``calls``
    like ``checked_kernels``'s: the fp32-output GEMM accumulation (``ops/wgrad.accumulate_mm``, as the linear layers
    and the losses import it; the GEMM loss's ``_mm_into``), RoPE's Triton kernel, the Triton RMSNorm and SwiGLU
    backwards (the compact backward's gathered rows included), the loss's shard maths (whichever backend
    ``loss.impl=auto`` picked, against the chunked torch reference)."""
    from megasparse.loss import cce_gemm, materialized
    from megasparse.ops import attention as attn
    from megasparse.ops import prefix_attention as pa
    from megasparse.ops import rmsnorm_kernels, rope_kernels, rowwise
    from megasparse.parallel import layers

    def note(op, a, b, rel):
        calls.append(dict(op=op, q=tuple(a.shape), k=tuple(b.shape), causal=None, bias=False, rel=rel))

    def accumulate(real):
        def run(out, a, b):
            before = out.detach().double().cpu()
            real(out, a, b)
            note("accumulate_mm", a, b, _rel(out.double().cpu() - before, a.double().cpu() @ b.double().cpu()))

        return run

    for mod in (layers, materialized, cce_gemm):
        monkeypatch.setattr(mod, "accumulate_mm", accumulate(mod.accumulate_mm))
    mm_into = cce_gemm._mm_into

    def checked_mm_into(a, b, out):
        got = mm_into(a, b, out)
        note("cce_gemm._mm_into", a, b, _rel(got, a.double().cpu() @ b.double().cpu()))
        return got

    monkeypatch.setattr(cce_gemm, "_mm_into", checked_mm_into)

    def rope(real):
        def run(out, x, cos, sin, pos, inverse=False):
            got = real(out, x, cos, sin, pos, inverse)
            note("rope_into", x, pos, _rel(got, rope_kernels.rope_reference(x.double(), cos, sin, pos, inverse)))
            return got

        return run

    for mod in (attn, pa):
        monkeypatch.setattr(mod, "rope_into", rope(mod.rope_into))
    rms_backward = rowwise.rms_backward

    def checked_rms(x, w, g, eps, rows=None):
        dx, dw = rms_backward(x, w, g, eps, rows=rows)
        xs = x.reshape(-1, x.shape[-1]) if rows is None else x.reshape(-1, x.shape[-1]).index_select(0, rows)
        rdx, rdw = rmsnorm_kernels.rms_backward_reference(xs.double(), w.double(), g.reshape(xs.shape).double(), eps)
        note("rms_backward", g, w, max(_rel(dx.reshape(rdx.shape), rdx), _rel(dw, rdw)))
        return dx, dw

    monkeypatch.setattr(rowwise, "rms_backward", checked_rms)
    glu_backward = rowwise.glu_backward_triton

    def checked_glu(z, grad_out, kind="swiglu", rows=None):
        dz = glu_backward(z, grad_out, kind, rows=rows)
        zs = z if rows is None else z.index_select(0, rows)
        note("glu_backward", grad_out, z, _rel(dz, rowwise._swiglu_bwd(zs.double(), grad_out.double())))
        return dz

    monkeypatch.setattr(rowwise, "glu_backward_triton", checked_glu)
    from megasparse.loss import core, reference

    fwd, bwd = core.shard_forward, core.shard_backward

    def checked_forward(h, w, tgt, n_valid, softcap=None, backend=None):
        got = fwd(h, w, tgt, n_valid, softcap, backend)
        want = reference.torch_shard_forward(h.double(), w.double(), tgt, n_valid, softcap)
        note(f"loss forward ({backend})", h, w, max(_rel(a, b) for a, b in zip(got, want)))
        return got

    def checked_backward(h, w, tgt, lse, gs, gt, n_valid, softcap=None, filter_eps=None, perm=None, *args, **kw):
        dc_out = kw.get("dc_out", args[2] if len(args) > 2 else None)
        before = None if dc_out is None else dc_out.detach().double().cpu()
        d_e, d_c = bwd(h, w, tgt, lse, gs, gt, n_valid, softcap, filter_eps, perm, *args, **kw)
        r_e, r_c = reference.torch_shard_backward(h.double(), w.double(), tgt, lse.double(), gs.double(),
                                                  gt.double(), n_valid, softcap)  # fmt: skip
        dc = d_c if before is None else dc_out.double().cpu() - before
        floor = 1e-2 * float(r_c.norm())  # an exact filter's skipped entries are below bf16's reach
        note("loss backward", h, w, max(_rel(d_e, r_e, floor), _rel(dc, r_c, floor)))
        return d_e, d_c

    monkeypatch.setattr(core, "shard_forward", checked_forward)
    monkeypatch.setattr(core, "shard_backward", checked_backward)
