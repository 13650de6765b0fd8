"""Causal self-attention core (RoPE + GQA + flash attention) with a filter-aware backward.

Input is the column-parallel QKV projection [s, b, (nq + 2·nkv)·d] of this TP rank's heads,
laid out [q heads | k heads | v heads]; output [s, b, nq·d]. Forward runs a fused kernel (cuDNN
attention on CUDA, flash if cuDNN is unavailable, the CPU flash kernel on CPU) and keeps its output
and log-sum-exp. A dense gradient
gets the kernel's own backward. A ``CompactGrad`` (token filtering, Collider semantics) gets, per
sequence, the same backward kernel on the kept queries/keys/values only, with the forward's
output and log-sum-exp rows of the kept queries: gradients flow only among kept tokens, and RoPE
is undone at the tokens' original positions.

With ``docs`` (``data.document_attention``, decision 1200) a token attends only to its own document's earlier tokens and
RoPE rotates it at its position in the document: the kernels take the mask as an additive bias (cuDNN on CUDA, the
memory-efficient kernel if cuDNN refuses it, the CPU flash kernel on CPU) or, per ``DocSpans.kernel``, FlexAttention
with a block mask (``doc_flex.py``, decision 1201: empty tiles skipped; the dense backward through the forward's kept
flex graph, decision 1202, or under recompute a recomputed flex forward); the compact backward builds the bias of the
kept rows, which keep their document and position, whichever kernel ran the forward.
"""

from __future__ import annotations

import math

import torch

from megasparse.ops import doc_flex
from megasparse.ops.compact import CompactGrad
from megasparse.ops.documents import DocSpans, additive_bias
from megasparse.ops.rope_kernels import rope_into


def llama3_inv_freq(inv: torch.Tensor, factor: float, low: float, high: float, original: int) -> torch.Tensor:
    """Llama-3.1's RoPE scaling: wavelengths longer than original/low are divided by ``factor``, shorter than
    original/high kept, and those between blended linearly in original/wavelength."""
    wavelen = 2 * math.pi / inv
    ratio = original / wavelen
    smooth = ((ratio - low) / (high - low)).clamp(0.0, 1.0)  # 0 at the long end, 1 at the short end
    return inv / factor * (1 - smooth) + inv * smooth


def rope_tables(
    seq: int,
    dim: int,
    theta: float,
    device,
    dtype=torch.float32,
    scaling: tuple[float, float, float, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [seq, dim/2] of RoPE angles, computed in fp64; ``scaling``: Llama-3's (factor, low, high, original
    positions), see ``llama3_inv_freq``."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim))
    if scaling is not None:
        inv = llama3_inv_freq(inv, *scaling)
    ang = torch.outer(torch.arange(seq, device=device, dtype=torch.float64), inv)
    return ang.cos().to(dtype), ang.sin().to(dtype)


_ATEN = torch.ops.aten
"""The kernels' namespace: tests/cuda_emulation.py swaps in emulated CUDA kernels (with ``_on_gpu``) so the CUDA
branches below run on CPU, or wraps the real ones to check every call of a GPU run."""


def _on_gpu(t: torch.Tensor) -> bool:
    """Whether ``t``'s attention takes the CUDA kernels (the seam the emulation swaps)."""
    return t.is_cuda


_CUDNN = {"ok": True}
"""cuDNN attention is used on CUDA (bf16/fp16) until a call of it fails; then flash attention, with one warning."""


def _cudnn_off(e: Exception) -> None:
    import warnings

    _CUDNN["ok"] = False
    warnings.warn(f"megasparse: cuDNN attention unavailable ({type(e).__name__}: {e}); using flash", stacklevel=3)


_CUDNN_BIAS = {"ok": True}
"""cuDNN attention with a document-mask bias, until a call of it fails; then the memory-efficient kernel."""


def _cudnn_bias_off(e: Exception) -> None:
    import warnings

    _CUDNN_BIAS["ok"] = False
    warnings.warn(
        f"megasparse: cuDNN attention with a document mask unavailable ({type(e).__name__}: {e}); using the "
        "memory-efficient kernel",
        stacklevel=3,
    )


def _cudnn_takes(s_q: int, s_k: int) -> bool:
    """Whether cuDNN gets a call of these lengths: never one of length 1 (or 0). torch's own SDPA dispatcher refuses
    cuDNN for a key length of 1 (pytorch#138531: wrong results, pytorch#138529), and megasparse calls the kernel
    directly, so it must refuse too: Collider's compact backward hands the kernels the kept rows, which can be one
    (a short document keeping one token, the tail rows of a packed last chunk). Those calls take flash, or the
    memory-efficient kernel under a document mask, with cuDNN's output and lse."""
    return s_q > 1 and s_k > 1


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA's shared key/value heads repeated to ``heads`` for the kernels that want them whole."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _group_sum(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[1] == heads else t.unflatten(1, (heads, t.shape[1] // heads)).sum(2)


def _doc_bias(docs: DocSpans, q: torch.Tensor, rows: torch.Tensor | None = None, key=None) -> torch.Tensor:
    """The documents' mask as the kernels' bias, memoised per micro-batch (every layer reads the same)."""
    align = 16 if _on_gpu(q) else 1
    return docs.derived(("bias", key, q.dtype, align), lambda: additive_bias(docs.allowed(rows), q.dtype, align))


def _flash_fwd(q, k, v, scale, bias=None, causal: bool = True):
    """(out [b, h, s, d], lse [b, h, s] fp32, rng state for the backward); k, v may have fewer (GQA) heads.

    ``bias``: a document mask, additive [b, 1, s, s] (0 or −inf, causality included), instead of is_causal: cuDNN
    takes it as it is, the memory-efficient kernel broadcast to every head, the CPU kernel as ``attn_mask``; flash
    takes none (decision 1200). ``causal=False`` (no bias): every query sees every key (ChunkFlow's earlier chunks,
    ``ops/prefix_attention.py``)."""
    masked = bias is not None
    causal = causal and not masked
    if (_on_gpu(q) and q.dtype in (torch.bfloat16, torch.float16) and _CUDNN["ok"] and (not masked or _CUDNN_BIAS["ok"])
            and _cudnn_takes(q.shape[2], k.shape[2])):  # fmt: skip
        # cuDNN: 1.6x flash's forward and backward on H100 at s=4096 (docs/decisions/0007); it takes GQA's key/value
        # heads as they are (no repeated copies; fwd+bwd 2.84 -> 2.53 ms at b=4, 32/4 heads, decision 0010)
        try:
            r = _ATEN._scaled_dot_product_cudnn_attention(q, k, v, bias, True, 0.0, causal, False, scale=scale)
            return r[0], r[1].view(r[1].shape[:3]), ("cudnn", r[6], r[7])
        except RuntimeError as e:
            (_cudnn_bias_off if masked else _cudnn_off)(e)
    k, v = _expand(k, q.shape[1]), _expand(v, q.shape[1])
    if _on_gpu(q) and q.dtype in (torch.bfloat16, torch.float16) and not masked:
        r = _ATEN._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return r[0], r[1], ("flash", r[6], r[7])
    if _on_gpu(q):  # fp32 on GPU, or a document mask: efficient-attention path
        full = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2]) if masked else None
        r = _ATEN._scaled_dot_product_efficient_attention(q, k, v, full, True, 0.0, causal, scale=scale)
        return r[0], r[1], ("efficient", r[2], r[3])
    out, lse = _ATEN._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
    return out, lse, None


def _flash_bwd(g, q, k, v, out, lse, rng, scale, bias=None, causal: bool = True):
    """dq, dk, dv of causal attention on whatever rows are given (all, or the kept ones with their lse rows);
    dk, dv come back with k's and v's (GQA) head count. ``bias``: the document mask of these rows; ``causal``:
    as in ``_flash_fwd``. ``lse`` in any layout: each branch lays it out for the kernel it calls (``_aligned_rows``),
    which may not be the forward's (a cuDNN forward, a flash or memory-efficient backward)."""
    s_q, s_k = q.shape[2], k.shape[2]
    masked = bias is not None
    causal = causal and not masked
    if (rng is not None and rng[0] == "cudnn" and _CUDNN["ok"] and (not masked or _CUDNN_BIAS["ok"])
            and _cudnn_takes(s_q, s_k)):  # fmt: skip
        if g.stride() != out.stride():  # cuDNN wants dO laid out like O
            g = torch.empty_like(out).copy_(g)
        stats = lse.contiguous().unsqueeze(-1)
        try:
            return _ATEN._scaled_dot_product_cudnn_attention_backward(
                g, q, k, v, out, stats, rng[1], rng[2], bias, None, None, s_q, s_k, 0.0, causal, scale=scale
            )[:3]
        except RuntimeError as e:  # flash's (or the efficient) backward takes cuDNN's out and lse as they are
            (_cudnn_bias_off if masked else _cudnn_off)(e)
    nkv, heads = k.shape[1], q.shape[1]
    k, v = _expand(k, heads), _expand(v, heads)
    if rng is not None and rng[0] in ("flash", "cudnn") and not masked:
        dq, dk, dv = _ATEN._scaled_dot_product_flash_attention_backward(
            g, q, k, v, out, _aligned_rows(lse, "flash"), None, None, s_q, s_k, 0.0, causal, rng[1], rng[2], scale=scale
        )
    elif rng is not None:
        full = bias.expand(q.shape[0], heads, s_q, s_k) if masked else None
        rows = _aligned_rows(lse, "efficient")
        dq, dk, dv = _ATEN._scaled_dot_product_efficient_attention_backward(
            g, q, k, v, full, out, rows, rng[1], rng[2], 0.0, [True, True, True, False], causal, scale=scale
        )[:3]
    else:
        dq, dk, dv = _ATEN._scaled_dot_product_flash_attention_for_cpu_backward(
            g, q, k, v, out, lse.contiguous(), 0.0, causal, attn_mask=bias, scale=scale
        )
    return dq, _group_sum(dk, nkv), _group_sum(dv, nkv)


def _aligned_rows(lse: torch.Tensor, kernel: str) -> torch.Tensor:
    """``lse`` rows [b, h, m] as ``kernel``'s backward reads them: the memory-efficient kernel's with the head stride a
    multiple of 32 elements (it refuses others: its forward pads to 32), every other kernel's contiguous (flash
    ignores the strides of a padded layout and reads wrong rows: measured on H100). No copy when the rows are laid
    out so already (a forward's own lse)."""
    if kernel != "efficient":
        return lse.contiguous()
    if lse.stride(-1) == 1 and lse.stride(1) % 32 == 0:
        return lse
    b, h, m = lse.shape
    buf = lse.new_zeros(b, h, -(-m // 32) * 32)
    buf[..., :m] = lse
    return buf[..., :m]


def _rows_at(t: torch.Tensor, flat: torch.Tensor, b: int, m: int) -> torch.Tensor:
    """[b, h, m, d]: ``t`` [b, h, s, d] at the kept positions (``flat`` = position·b + sequence, [b·m]). One row
    gather (index_select) when t is a view of [s, b, h·d] rows, as q, k, v and cuDNN's output are; an
    elementwise gather along s otherwise."""
    _, h, s, d = t.shape
    try:
        rows = t.permute(2, 0, 1, 3).view(s * b, h * d)
    except RuntimeError:
        pos = (flat.view(b, m) // b)[:, None, :, None]
        return t.gather(2, pos.expand(-1, h, -1, d))
    return rows.index_select(0, flat).view(b, m, h, d).permute(0, 2, 1, 3)


def _rotated(
    qkv: torch.Tensor,
    nq: int,
    nkv: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    docs: DocSpans | None = None,
    offset: int = 0,
):
    """(q, k, v) [b, heads, s, d] of the QKV rows: q and k rotated into one [s, b, heads, d] buffer like qkv, v a
    view of qkv. ``docs``: rotated at each token's position in its document; ``offset``: the position of the first
    row (ChunkFlow's later chunks of a sequence)."""
    s, b, _ = qkv.shape
    d = qkv.shape[-1] // (nq + 2 * nkv)
    heads = qkv.view(s, b, nq + 2 * nkv, d)
    qk = qkv.new_empty(s, b, nq + nkv, d)
    positions = torch.arange(offset, offset + s, device=qkv.device) if docs is None else docs.rope_positions()
    rope_into(qk.permute(1, 2, 0, 3), heads[:, :, : nq + nkv].permute(1, 2, 0, 3), cos, sin, positions)
    q = qk[:, :, :nq].permute(1, 2, 0, 3)  # [b, nq, s, d]
    k = qk[:, :, nq:].permute(1, 2, 0, 3)
    return q, k, heads[:, :, nq + nkv :].permute(1, 2, 0, 3)


class AttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        qkv: torch.Tensor,
        nq: int,
        nkv: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        recompute: bool = False,
        bias: torch.Tensor | None = None,
        docs: DocSpans | None = None,
        keep_graph: bool = False,
    ):
        """``recompute`` (``model.recompute=selective``, decision 0012): save qkv, the output and the lse only, and
        rotate q and k again in the backward. The output is the projection's saved input anyway (the same storage
        under cuDNN), so rerunning the flash forward would free nothing more. ``bias`` (Qwen2's q/k/v biases) is
        added before RoPE; its gradient is dqkv summed over tokens. ``docs``: attention within documents.
        ``keep_graph``: on the flex path, keep flex's autograd graph for the dense backward (decision 1202; the
        caller says a gradient is wanted and no recompute runs, ``doc_flex.keeps_graph`` checks the rest)."""
        if bias is not None:
            qkv = qkv + bias
        s, b, _ = qkv.shape
        q, k, v = _rotated(qkv, nq, nkv, cos, sin, docs)
        d = q.shape[-1]
        scale = d**-0.5
        flex = docs is not None and doc_flex.chosen(docs.kernel, q)
        ctx.graph = None  # flex's (leaves, output) under autograd, for the dense backward (decision 1202)
        if flex:  # FlexAttention's block mask (decision 1201); a compact backward takes the bias kernels' backward
            try:
                if not recompute and doc_flex.keeps_graph(q, keep_graph):
                    out, lse, leaves, out_graph = doc_flex.flex_forward_graph(q, k, v, docs, scale)
                    ctx.graph = (leaves, out_graph)  # not saved tensors: no hook may be active (keeps_graph)
                else:
                    out, lse = doc_flex.flex_forward(q, k, v, docs, scale)
                rng = doc_flex.bias_rng(q, docs)
            except Exception as e:  # noqa: BLE001 - a compiler's or kernel's failure: the bias path takes over
                doc_flex.flex_failed(e, q)
                flex = False
        if not flex:
            mask = None if docs is None else _doc_bias(docs, q)
            out, lse, rng = _flash_fwd(q, k, v, scale, mask)  # k, v keep GQA's nkv heads (saved: 1/group the memory)
        y = out.permute(2, 0, 1, 3).reshape(s, b, nq * d)
        if flex:  # flex lays its output out like q ([s, b, h, d] rows): y is a view of it; the saved output too
            out = y.view(s, b, nq, d).permute(1, 2, 0, 3)
        if recompute:
            ctx.save_for_backward(qkv, y, lse, cos, sin)
        else:
            ctx.save_for_backward(q, k, v, out, lse, cos, sin)
        ctx.recompute, ctx.docs, ctx.flex = recompute, docs, flex
        ctx.meta = (nq, nkv, d, scale, rng, qkv.shape, bias is not None)
        return y

    @staticmethod
    def backward(ctx, g):
        nq, nkv, d, scale, rng, shape, has_bias = ctx.meta
        s, b, _ = shape
        docs: DocSpans | None = ctx.docs
        graph, ctx.graph = ctx.graph, None  # the kept flex graph goes with this backward, whichever path it takes
        if ctx.recompute:
            qkv, y, lse, cos, sin = ctx.saved_tensors
            q, k, v = _rotated(qkv, nq, nkv, cos, sin, docs)
            out = y.view(s, b, nq, d).permute(1, 2, 0, 3)
        else:
            q, k, v, out, lse, cos, sin = ctx.saved_tensors

        def bias_grad(rows: torch.Tensor) -> torch.Tensor | None:
            return rows.reshape(-1, shape[-1]).sum(0) if has_bias else None

        def finish(dq, dk, dv, pos):
            # dq [bb, nq, t, d], dk/dv [bb, nkv, t, d] -> rows [t, bb, (nq+2nkv)d] with RoPE undone at ``pos``.
            bb, _, t, _ = dq.shape  # pos: [t] shared, or [bb, t] per sequence
            rows = dq.new_empty(t, bb, nq + 2 * nkv, d)  # written in place: no cat of strided kernel outputs
            heads = rows.permute(1, 2, 0, 3)
            rope_into(heads[:, :nq], dq, cos, sin, pos, inverse=True)
            rope_into(heads[:, nq : nq + nkv], dk, cos, sin, pos, inverse=True)
            heads[:, nq + nkv :].copy_(dv)
            return rows.flatten(2)

        if not isinstance(g, CompactGrad):
            go = g.view(s, b, nq, d).permute(1, 2, 0, 3)
            if docs is None:
                dq, dk, dv = _flash_bwd(go, q, k, v, out, lse, rng, scale)
                dqkv = finish(dq, dk, dv, torch.arange(s, device=q.device)).reshape(shape)
            else:
                dq = None
                if ctx.flex and doc_flex.has_backward(q) and doc_flex.chosen(docs.kernel, q):
                    try:  # the forward's flex graph (decision 1202), else the flex forward again (decision 1201)
                        if graph is not None:
                            dq, dk, dv = torch.autograd.grad(graph[1], graph[0], go)
                        else:
                            dq, dk, dv = doc_flex.flex_backward(go, q, k, v, docs, scale)
                    except Exception as e:  # noqa: BLE001 - as in the forward: the bias kernels' backward instead
                        doc_flex.flex_failed(e, q)
                if dq is None:  # the bias kernels' backward (after a flex forward too: its out and lse are the same)
                    dq, dk, dv = _flash_bwd(go, q, k, v, out, lse.contiguous(), rng, scale, _doc_bias(docs, q))
            if docs is not None:
                dqkv = finish(dq, dk, dv, docs.rope_positions()).reshape(shape)
            return dqkv, None, None, None, None, None, bias_grad(dqkv), None, None

        del graph  # the compact backward takes the bias kernel with the forward's out and lse (decision 1201)
        # One batched kernel over the micro-batch: each sequence's kept positions, padded at the end to the
        # longest. Padded queries get a zero output gradient, so they add nothing to any real dq/dk/dv, and
        # causal order keeps real queries off the padded keys: exact, whatever the per-sequence counts.
        # Static counts (every sequence keeps the same number: the trainer's default selection) need no padding row;
        # one sequence that keeps any rows needs no reordering either (its compact rows are its kept positions, in
        # order).
        pos, sel = g.meta.padded_per_sequence()  # [b, m] positions, [b, m] compact rows (K = padding)
        k_rows, m = g.rows.shape[0], pos.shape[1]
        padded = g.meta.seq_count is None
        in_order = b == 1 and k_rows == m
        if in_order:
            go = g.rows.reshape(b, m, nq, d).permute(0, 2, 1, 3)
        else:
            src = torch.cat([g.rows, g.rows.new_zeros(1, g.rows.shape[1])]) if padded else g.rows
            go = src.index_select(0, sel.reshape(-1)).view(b, m, nq, d).permute(0, 2, 1, 3)
        flat = g.meta.derived(  # rows of the [s, b] layout, the same for every layer
            "attn_flat", lambda: (pos * b + torch.arange(b, device=pos.device)[:, None]).reshape(-1)
        )
        sub = [_rows_at(t, flat, b, m) for t in (q, k, v, out)]
        lse_b = lse.gather(2, pos[:, None, :].expand(-1, lse.shape[1], -1))
        if docs is None:
            dq, dk, dv = _flash_bwd(go, *sub[:3], sub[3], lse_b, rng, scale)
            got = finish(dq, dk, dv, pos).reshape(-1, shape[-1])
        else:  # kept rows keep their document and their position in it
            kept_bias = _doc_bias(docs, q, pos, key=g.meta)
            dq, dk, dv = _flash_bwd(go, *sub[:3], sub[3], lse_b, rng, scale, kept_bias)
            doc_pos = docs.derived(("kept_pos", g.meta), lambda: docs.rope_positions().gather(1, pos))
            got = finish(dq, dk, dv, doc_pos).reshape(-1, shape[-1])
        db = bias_grad(got)  # padded queries' rows are zeros: they add nothing
        if in_order:
            return CompactGrad(got, g.meta, shape), None, None, None, None, None, db, None, None
        rows = g.rows.new_empty(k_rows + padded, shape[-1])  # with padding, the last row takes (and drops) it
        rows.index_copy_(0, sel.t().reshape(-1), got)
        return CompactGrad(rows[:k_rows], g.meta, shape), None, None, None, None, None, db, None, None


def attention(
    qkv: torch.Tensor,
    nq: int,
    nkv: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    recompute: bool = False,
    bias: torch.Tensor | None = None,
    docs: DocSpans | None = None,
    keep_graph: bool = True,
) -> torch.Tensor:
    """Causal GQA attention of this rank's [q | k | v] heads. ``recompute``: rotate q and k again in the backward
    instead of saving them; ``bias`` ([(nq + 2·nkv)·d]) is added before RoPE; ``docs``: each token attends within
    its document only, rotated at its position in it (``data.document_attention``). ``keep_graph=False``: the
    caller recomputes the layer (``model.recompute=full``), so flex's dense backward reruns its forward instead of
    keeping its graph (decision 1202)."""
    wants_grad = qkv.requires_grad or (bias is not None and bias.requires_grad)
    keep_graph = keep_graph and docs is not None and torch.is_grad_enabled() and wants_grad
    return AttentionFn.apply(qkv, nq, nkv, cos, sin, recompute, bias, docs, keep_graph)
