"""Causal attention of one chunk of a long sequence over the keys/values of the sequence's earlier chunks
(ChunkFlow's state-aware chunks, ``megasparse/chunkflow/``, decision 1220).

Chunk j of a sequence holds positions [offset, offset + s). Its queries see every key of the earlier chunks (the
prefix, already rotated, kept by the caller) and their own chunk's keys causally. The kernels are the ones
``ops/attention.py`` dispatches (cuDNN, flash, efficient, the CPU flash kernel), called twice: once causal on the
chunk's own keys, once non-causal on the prefix, and the two partial results merged by their log-sum-exps (the
merge ring attention uses). The backward runs each kernel's own backward with the *merged* output and log-sum-exp,
which makes each part's probabilities the whole softmax's restricted to its keys: exact, no mask tensor, and no
alignment question for causal attention between unequal query and key lengths.

The prefix is not an autograd input: the caller's ``PrefixSource`` hands the keys/values in the forward (and again
in the backward: nothing of the prefix is saved here) and receives their gradients in the backward
(``add_grad``). The chunk's own rotated keys and values are extra outputs, so a caller can keep them for the later
chunks and feed the gradients those later chunks produced back into this chunk's backward.

A sequence's last chunk may also hold packed short documents after its tail (``chunkflow.pack_tails``, decision
1233): ``docs`` then masks the chunk's own attention by document and gives each row its RoPE position (the tail's
from ``offset``, the others' from 0), and only the first ``head`` rows (the tail) attend to the prefix, merged into
those rows alone; the other documents' rows never read or train the prefix, in the compact backward too. Where
``data.document_attention_kernel`` picks FlexAttention (``doc_flex.chosen``) such a chunk runs ``tail_flex.py``
instead: one flex call over prefix ++ own keys with that mask, no merge, flex's backward (decision 1239); the
compact backward and the CPU's dense backward keep the bias kernels, fed flex's output and lse.
"""

from __future__ import annotations

from typing import Protocol

import torch

from megasparse.ops import doc_flex, tail_flex
from megasparse.ops.attention import _doc_bias, _flash_bwd, _flash_fwd, _rotated, _rows_at
from megasparse.ops.compact import CompactGrad
from megasparse.ops.documents import DocSpans
from megasparse.ops.rope_kernels import rope_into

__all__ = ["PrefixSource", "prefix_attention", "prefix_attention_reference"]


class PrefixSource(Protocol):
    """The rotated keys/values of a sequence's earlier chunks for one layer, and where their gradients go."""

    def prefix(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k, v) [b, nkv, P, d] of the P earlier positions, or None for a sequence's first chunk."""

    def add_grad(self, dk: torch.Tensor, dv: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Add the prefix keys'/values' gradients ([b, nkv, P, d]) from this chunk's backward; ``rows``: they are
        the gradients of those prefix positions only ([b, nkv, len(rows), d], the compact backward)."""

    def kept(self) -> torch.Tensor | None:
        """Prefix positions whose keys/values train under Collider (ascending), None: every one."""


def _merge(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor):
    """Two attention results over disjoint key sets combined into the one over their union: (out, lse); ``o2`` may
    cover only the first rows of ``o1`` (a packed last chunk's tail), the others keep ``o1``'s. The lse keeps the
    first result's layout (the efficient kernel pads its rows); the arithmetic is fp32 or wider."""
    s, acc = o2.shape[2], torch.promote_types(o1.dtype, torch.float32)
    a, c = l1[..., :s].to(acc), l2[..., :s].to(acc)
    m = torch.logaddexp(a, c)
    out = torch.empty_like(o1)  # o1's strides (cuDNN wants dO laid out like O in the backward)
    out[:, :, :s].copy_(o1[:, :, :s].to(acc) * (a - m).exp().unsqueeze(-1) + o2.to(acc) * (c - m).exp().unsqueeze(-1))
    if s < o1.shape[2]:
        out[:, :, s:].copy_(o1[:, :, s:])
    lse = l1.clone()
    lse[..., :s] = m.to(lse.dtype)
    return out, lse


class PrefixAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, nq: int, nkv: int, cos, sin, offset: int, source: PrefixSource, bias, docs, head, wants,
                width):  # fmt: skip
        if bias is not None:
            qkv = qkv + bias
        s, b, _ = qkv.shape
        q, k, v = _rotated(qkv, nq, nkv, cos, sin, docs, offset=offset)
        d = q.shape[-1]
        scale = d**-0.5
        pre = source.prefix()
        ctx.graph = None  # flex's (leaves, output) under autograd, for the dense backward (decisions 1202, 1239)
        keep = head is not None and doc_flex.keeps_graph(q, wants)
        flex = head is not None and tail_flex.chosen(docs, q, 0 if pre is None else pre[0].shape[2], keep, width)
        if flex:  # a packed last chunk on FlexAttention: one call over prefix ++ own keys (decision 1239)
            try:
                out, lse, k_out, v_out, ctx.graph = tail_flex.forward(q, k, v, pre, docs, head, scale, keep, width)
                rng = rng_p = doc_flex.bias_rng(q, docs)  # the bias kernels' backward, where flex has none
            except Exception as e:  # noqa: BLE001 - a compiler's or kernel's failure: the bias kernels take over
                doc_flex.flex_failed(e, q)
                flex = False
        if not flex:
            out, lse, rng = _flash_fwd(q, k, v, scale, None if docs is None else _doc_bias(docs, q))
            rng_p = None
            if pre is not None:
                o_p, l_p, rng_p = _flash_fwd(q[:, :, :head], pre[0], pre[1], scale, causal=False)
                out, lse = _merge(out, lse, o_p, l_p)
            k_out, v_out = k.contiguous(), v.contiguous()  # [b, nkv, s, d]: what the later chunks read
        y = out.permute(2, 0, 1, 3).reshape(s, b, nq * d)
        ctx.save_for_backward(q, k_out, v_out, out, lse, cos, sin)
        ctx.meta = (nq, nkv, d, scale, rng, rng_p, offset, qkv.shape, bias is not None)
        ctx.source, ctx.docs, ctx.head, ctx.flex, ctx.width = source, docs, head, flex, width
        ctx.set_materialize_grads(False)  # a chunk without later chunks gets no k/v gradient: no zeros made for it
        return y, k_out, v_out

    @staticmethod
    def backward(ctx, g, gk, gv):
        graph, ctx.graph = ctx.graph, None  # the kept flex graph goes with this backward, whichever path it takes
        if isinstance(g, CompactGrad):
            del graph  # the compact backward takes the bias kernels with the forward's out and lse (decision 1201)
            return _compact_backward(ctx, g, gk, gv)
        nq, nkv, d, scale, rng, rng_p, offset, shape, has_bias = ctx.meta
        q, k, v, out, lse, cos, sin = ctx.saved_tensors
        s, b, w = shape
        go = g.reshape(s, b, nq, d).permute(1, 2, 0, 3)
        docs, head = ctx.docs, ctx.head
        pre = ctx.source.prefix()  # the same tensors as in the forward (the caller keeps them until this backward)
        grads = _flex_backward(ctx, graph, go, q, k, v, pre) if ctx.flex else None
        if grads is not None:
            dq, dk, dv = grads
        else:  # the bias kernels (after a flex forward too: its out and lse are the merged ones)
            if ctx.flex:  # its k, v are views of the concatenated keys: laid out as the kernels expect them
                k, v = k.contiguous(), v.contiguous()
            dq, dk, dv = _flash_bwd(go, q, k, v, out, lse, rng, scale, None if docs is None else _doc_bias(docs, q))
            if pre is not None and head is None:
                dq_p, dkp, dvp = _flash_bwd(go, q, pre[0], pre[1], out, lse, rng_p, scale, causal=False)
                dq = dq + dq_p
                ctx.source.add_grad(dkp, dvp)
            elif pre is not None:  # only the tail's rows saw the prefix
                dkp, dvp = _prefix_rows_bwd(dq, go, q, out, lse[..., :head], pre, rng_p, scale, head)
                ctx.source.add_grad(dkp, dvp)
        if gk is not None:  # the later chunks' gradients of this chunk's keys/values
            dk = dk + gk
        if gv is not None:
            dv = dv + gv
        pos = torch.arange(offset, offset + s, device=q.device) if docs is None else docs.rope_positions()[0]
        dqkv = _unrotated(dq, dk, dv, cos, sin, pos).reshape(shape)
        db = dqkv.reshape(-1, w).sum(0) if has_bias else None
        return dqkv, None, None, None, None, None, None, db, None, None, None, None


def _flex_backward(ctx, graph, go, q, k, v, pre):
    """A packed last chunk's dense backward through flex (decision 1239; its prefix gradients sent to the source),
    or None where torch has no flex backward (CPU) or flex failed (the bias kernels run instead)."""
    if not (doc_flex.has_backward(q) and doc_flex.chosen(ctx.docs.kernel, q)):
        return None
    try:  # the prefix's gradients come from the tail's rows only (the mask)
        dq, dk, dv, dkp, dvp = tail_flex.backward(go, graph, q, k, v, pre, ctx.docs, ctx.head, ctx.meta[3], ctx.width)
    except Exception as e:  # noqa: BLE001 - as in the forward: the bias kernels' backward instead
        doc_flex.flex_failed(e, q)
        return None
    if dkp is not None:
        ctx.source.add_grad(dkp, dvp)
    return dq, dk, dv


def _prefix_rows_bwd(dq, go, q, out, lse, pre, rng, scale: float, rows: int):
    """The prefix part's backward for the first ``rows`` queries only (``lse``: theirs), their dq added into
    ``dq`` in place; returns the prefix keys'/values' gradients. The lse is laid out afresh for the prefix kernel
    (``_flash_bwd``: the chunk's own, document-masked kernel may be another one); the output's rows are copied out
    of the chunk's layout, so that cuDNN gets dO laid out like O (a view of the first rows keeps the whole chunk's
    strides)."""
    out = out[:, :, :rows].contiguous()
    dq_p, dkp, dvp = _flash_bwd(go[:, :, :rows], q[:, :, :rows], pre[0], pre[1], out, lse, rng, scale,
                                causal=False)  # fmt: skip
    dq[:, :, :rows] += dq_p
    return dkp, dvp


def _unrotated(dq, dk, dv, cos, sin, pos: torch.Tensor) -> torch.Tensor:
    """[t, b, (nq + 2·nkv)·d] input rows from dq [b, nq, t, d], dk/dv [b, nkv, t, d], RoPE undone at ``pos``."""
    b, nq, t, d = dq.shape
    nkv = dk.shape[1]
    rows = dq.new_empty(t, b, nq + 2 * nkv, d)
    heads = rows.permute(1, 2, 0, 3)
    rope_into(heads[:, :nq], dq, cos, sin, pos, inverse=True)
    rope_into(heads[:, nq : nq + nkv], dk, cos, sin, pos, inverse=True)
    heads[:, nq + nkv :].copy_(dv)
    return rows.flatten(2)


def _compact_backward(ctx, g: CompactGrad, gk, gv):
    """Collider: the kept rows' backward (one sequence per chunk: ``g.meta.idx`` are the kept positions)."""
    nq, nkv, d, scale, rng, rng_p, offset, shape, has_bias = ctx.meta
    q, k, v, out, lse, cos, sin = ctx.saved_tensors
    s, b, w = shape
    assert b == 1, "a ChunkFlow chunk is one sequence (train.micro_batch_size=1)"
    pos = g.meta.idx  # ascending kept positions of the chunk (row = position·b + 0)
    m = pos.numel()
    go = g.rows.reshape(1, m, nq, d).permute(0, 2, 1, 3)
    qs, ks, vs, os_ = (_rows_at(t, pos, 1, m) for t in (q, k, v, out))
    lse_s = lse.index_select(2, pos)
    docs, head = ctx.docs, ctx.head
    # causal over the kept rows' order = causal over their positions (queries and keys are the same rows); packed
    # documents: the kept rows keep their document
    mask = None if docs is None else _doc_bias(docs, q, pos.view(1, -1), key=g.meta)
    dq, dk, dv = _flash_bwd(go, qs, ks, vs, os_, lse_s, rng, scale, mask)
    pre = ctx.source.prefix()
    if pre is not None:
        kept = ctx.source.kept()
        kp, vp = pre if kept is None else (pre[0].index_select(2, kept), pre[1].index_select(2, kept))
        if head is None:
            dq_p, dkp, dvp = _flash_bwd(go, qs, kp, vp, os_, lse_s, rng_p, scale, causal=False)
            dq = dq + dq_p
        else:  # the tail's kept rows only (one host sync per chunk: the count, shared by every layer)
            n = g.meta.derived(f"prefix_rows_{head}", lambda: int(torch.searchsorted(pos, head)))
            if n == 0:  # none of the tail's rows was kept: nothing reaches the prefix (no empty kernel call)
                dkp = dvp = None
            else:
                lse_h = lse.index_select(2, pos[:n])
                dkp, dvp = _prefix_rows_bwd(dq, go, qs, os_, lse_h, (kp, vp), rng_p, scale, n)
        if dkp is not None:
            ctx.source.add_grad(dkp, dvp, kept)
    if gk is not None:  # later chunks reached only this chunk's kept rows: the other rows' gradients are 0
        dk = dk + gk.index_select(2, pos)
    if gv is not None:
        dv = dv + gv.index_select(2, pos)
    at = pos + offset if docs is None else docs.rope_positions()[0].index_select(0, pos)
    rows = _unrotated(dq, dk, dv, cos, sin, at).reshape(m, w)
    db = rows.sum(0) if has_bias else None
    return CompactGrad(rows, g.meta, shape), None, None, None, None, None, None, db, None, None, None, None


def prefix_attention(
    qkv: torch.Tensor,
    nq: int,
    nkv: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    offset: int,
    source: PrefixSource,
    bias: torch.Tensor | None = None,
    docs: DocSpans | None = None,
    head: int | None = None,
    width: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y [s, b, nq·d], k, v [b, nkv, s, d]): a chunk at positions [offset, offset + s) attending to ``source``'s
    earlier keys/values and causally to its own; k (rotated) and v are this chunk's, for the later chunks.
    ``docs`` (b = 1, with ``head``): the chunk's rows [0, head) are the sequence's tail and the only ones that see
    the prefix; the rest are packed documents (attention within each, RoPE at ``docs``' positions, which for the
    tail's rows must already count from ``offset``). ``width``: on flex, such a chunk's prefix ++ own keys are padded
    to this length, so one compiled variant serves every prefix (``tail_flex``; ChunkFlow passes its longest
    sequence's n·C)."""
    assert (docs is None) == (head is None), "a packed last chunk names its documents and its tail's rows"
    wants = torch.is_grad_enabled() and (qkv.requires_grad or (bias is not None and bias.requires_grad))
    return PrefixAttentionFn.apply(qkv, nq, nkv, cos, sin, offset, source, bias, docs, head, wants, width)


def prefix_attention_reference(
    qkv: torch.Tensor,
    nq: int,
    nkv: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    offset: int,
    prefix_k: torch.Tensor | None,
    prefix_v: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    docs: DocSpans | None = None,
    head: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same in plain torch (differentiable in every input, the prefix included): RoPE by rotate-half at the
    chunk's positions, keys = prefix ++ own, a lower-right causal mask, softmax in fp32 or wider. ``keep``
    ([P + s] bool, prefix then own positions): Collider's semantics, the attention's keys, values and score columns
    of the other positions are cut from the graph (the caller masks the output gradient to the kept queries).
    ``docs``, ``head``: as in ``prefix_attention`` (own keys masked by document, the prefix seen by rows < head)."""
    if bias is not None:
        qkv = qkv + bias
    s, b, _ = qkv.shape
    d = qkv.shape[-1] // (nq + 2 * nkv)
    heads = qkv.view(s, b, nq + 2 * nkv, d).permute(1, 2, 0, 3)  # [b, H, s, d]
    acc = torch.promote_types(qkv.dtype, torch.float32)
    pos = torch.arange(offset, offset + s, device=qkv.device) if docs is None else docs.rope_positions()[0]
    c, sn = cos[pos].to(acc), sin[pos].to(acc)

    def rot(x):
        x1, x2 = x.to(acc).chunk(2, dim=-1)
        return torch.cat([x1 * c - x2 * sn, x2 * c + x1 * sn], dim=-1)

    q, k, v = rot(heads[:, :nq]), rot(heads[:, nq : nq + nkv]), heads[:, nq + nkv :].to(acc)
    keys, vals = k, v
    if prefix_k is not None:
        keys, vals = torch.cat([prefix_k.to(acc), k], 2), torch.cat([prefix_v.to(acc), v], 2)
    if keep is not None:
        col = keep[None, None, :, None]
        keys, vals = torch.where(col, keys, keys.detach()), torch.where(col, vals, vals.detach())
    rep = nq // nkv
    keys, vals = keys.repeat_interleave(rep, 1), vals.repeat_interleave(rep, 1)
    p = keys.shape[2] - s
    key_pos, query_pos = torch.arange(keys.shape[2], device=qkv.device), p + torch.arange(s, device=qkv.device)
    allowed = key_pos[None, :] <= query_pos[:, None]
    if docs is not None:
        tail = torch.arange(s, device=qkv.device)[:, None] < head
        allowed = torch.cat([tail.expand(s, p), docs.allowed()[0, 0]], 1)
    scores = (q @ keys.transpose(-1, -2)) * d**-0.5
    if keep is not None:
        scores = torch.where(keep[None, None, None, :], scores, scores.detach())
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    y = (probs @ vals).permute(2, 0, 1, 3).reshape(s, b, nq * d).to(qkv.dtype)
    return y, k.to(qkv.dtype), v.to(qkv.dtype)
