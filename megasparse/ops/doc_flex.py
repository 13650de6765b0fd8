"""Document attention with FlexAttention (``data.document_attention_kernel``, decision 1201).

The additive-bias path (decision 1200) computes every s × s score and reads an O(b·s²) bias. FlexAttention takes
the documents as a block mask instead: ``create_block_mask`` sorts the [s/128]² tiles of each sequence into empty
(skipped), full (no per-element mask) and partial (the ``mask_mod`` is evaluated inside the kernel), so only the
tiles on the documents' diagonal blocks are computed. The block mask is built on the device from
``DocSpans.segments`` (shapes fixed by [s, b]: no host sync, CUDA-graph friendly) and memoised per micro-batch in
``DocSpans.derived``: every layer shares it.

On CUDA flex_attention and create_block_mask run compiled (``torch.compile``, static shapes, compiled once lazily
on first use: the trainer's eager warm-up before any capture); on CPU eagerly (flex's unfused reference: it serves
the CPU tests, which run the same mask, lse and gradient plumbing as the GPU). flex exposes no backward that takes
a saved output and lse through public API, so its dense backward goes through autograd (decision 1202): the
forward runs flex under autograd on detached leaves of q, k, v and ``AttentionFn`` keeps that graph for the
backward (``flex_forward_graph``), unless recompute is on or a saved-tensor hook is active (``keeps_graph``:
tensors held by the graph would escape the checkpoint); then the backward reruns the flex forward under autograd
(``flex_backward``: one extra attention forward, decision 1201). torch has no flex backward on CPU; there the dense
backward is the CPU kernel's with the bias, fed flex's output and lse (exact: both are the same masked softmax).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from megasparse.ops.documents import DocSpans

__all__ = [
    "available",
    "block_mask",
    "chosen",
    "flex_backward",
    "flex_failed",
    "flex_forward",
    "flex_forward_graph",
    "has_backward",
    "keeps_graph",
]

BLOCK = 128
"""The block mask's tile (flex's default sparse block): the mask_mod's segment table is padded to a multiple."""

_FN: dict[str, Any] = {}
"""Lazily: the flex module, and on CUDA the compiled flex_attention and create_block_mask (one each per process)."""


def _module():
    if "mod" not in _FN:
        try:
            import torch.nn.attention.flex_attention as mod
        except ImportError:
            mod = None
        _FN["mod"] = mod
    return _FN["mod"]


def available() -> bool:
    """Whether this torch has FlexAttention."""
    return _module() is not None


_OK = {"ok": True}
"""FlexAttention runs on CUDA until a call of it (its compilation included) fails; then the bias path, one warning."""


def flex_failed(e: Exception, q: torch.Tensor) -> None:
    """A failed flex call on CUDA turns flex off for the process. Re-raised on CPU (tests want to see it) and inside
    a CUDA-graph capture: the capture fails, ``cudagraph`` says why in one line and stays eager, with flex."""
    import warnings

    if not q.is_cuda or torch.cuda.is_current_stream_capturing():
        raise e
    _OK["ok"] = False
    warnings.warn(f"megasparse: FlexAttention unavailable ({type(e).__name__}: {e}); using the bias", stacklevel=3)


def picks_flex(kernel: str, cuda: bool, half: bool) -> bool:
    """The rule of ``chosen`` before any tensor exists (a config resolving on it): ``flex`` always, ``auto`` on
    CUDA at bf16/fp16 (``half``), ``bias`` never."""
    return kernel == "flex" or (kernel == "auto" and cuda and half)


def chosen(kernel: str, q: torch.Tensor) -> bool:
    """Whether the documents' attention of ``q`` runs on flex (``picks_flex``, where this torch has flex); neither
    after a flex call failed on CUDA (``flex_failed``)."""
    if not _OK["ok"]:
        return False
    if kernel == "flex":
        return True
    return picks_flex(kernel, q.is_cuda, q.dtype in (torch.bfloat16, torch.float16)) and available()


def has_backward(q: torch.Tensor) -> bool:
    """Whether torch has a flex backward on ``q``'s device (not on CPU: the bias kernel's backward runs there)."""
    return q.device.type != "cpu"


def _fns(cuda: bool):
    """(flex_attention, create_block_mask): compiled on CUDA (static shapes), eager on CPU."""
    mod = _module()
    if not cuda:
        return mod.flex_attention, mod.create_block_mask
    if "cuda" not in _FN:
        _FN["cuda"] = (
            torch.compile(mod.flex_attention, dynamic=False),
            torch.compile(mod.create_block_mask, dynamic=False),
        )
    return _FN["cuda"]


def block_mask(docs: DocSpans, device: torch.device):
    """The micro-batch's BlockMask (causal and the same document; B = b, heads broadcast), built once per
    micro-batch. The segment table is padded to whole tiles so the kernel's reads past s stay in bounds."""

    def build():
        s, b = docs.segments.shape
        width = -(-s // BLOCK) * BLOCK
        seg = docs.segments.new_full((b, width), -1)
        seg[:, :s] = docs.segments.t()

        def same_document_causal(bi, hi, qi, ki):
            return (qi >= ki) & (seg[bi, qi] == seg[bi, ki])

        return _fns(device.type == "cuda")[1](same_document_causal, b, None, s, s, device=device)

    return docs.derived(("flex_mask", device.type), build)


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float, fn=None):
    """(out, lse): lse natural-log [b, h, s] fp32. torch >= 2.9 asks for it with ``return_aux=AuxRequest(lse=True)``,
    older with ``return_lse=True``; both return the natural logarithm (the kernels keep log2 statistics and the
    public function rescales them by ln 2; ``tests/test_doc_flex.py`` checks it against an fp64 logsumexp).
    ``fn``: flex_attention or a compiled wrapper of it (``tail_flex``'s); default: this module's."""
    mod, fn = _module(), fn or _fns(q.is_cuda)[0]
    if "aux" not in _FN:  # asked once: the signature is read on the host
        _FN["aux"] = "return_aux" in inspect.signature(mod.flex_attention).parameters
    if _FN["aux"]:
        out, aux = fn(q, k, v, block_mask=mask, scale=scale, enable_gqa=True, return_aux=mod.AuxRequest(lse=True))
        return out, aux.lse
    return fn(q, k, v, block_mask=mask, scale=scale, enable_gqa=True, return_lse=True)


def flex_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: DocSpans, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b, h, s, d], lse [b, h, s] fp32, natural log) of attention within documents; k, v at GQA's head
    count. No autograd graph (inside ``AttentionFn.forward``: v there is a view of the input that requires grad)."""
    return _flex(q.detach(), k.detach(), v.detach(), block_mask(docs, q.device), scale)


def flex_backward(
    g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: DocSpans, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (k, v's head count) of the dense backward: the flex forward again under autograd, then its
    backward with ``g`` (one extra attention forward; the block mask is the forward's, memoised)."""
    mask = block_mask(docs, q.device)
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, _ = _flex(*leaves, mask, scale)
        return torch.autograd.grad(out, leaves, g)


def hooks_active() -> bool:
    """Whether a saved-tensor hook is active (the full layer checkpoint's, the recompute of it in the backward, an
    offload hook): tensors held outside ``save_for_backward`` would escape it. torch has no public query; if its
    private one is missing, assume a hook is active (the recompute route is always safe)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return True
    try:
        return top(False) is not None
    except (TypeError, RuntimeError):
        return True


def keeps_graph(q: torch.Tensor, allowed: bool) -> bool:
    """Whether the flex forward keeps its autograd graph for the backward (decision 1202): ``allowed`` (the caller
    needs a gradient and runs no recompute: ``model.recompute=none``), torch has a flex backward on ``q``'s device,
    and no saved-tensor hook is active."""
    return allowed and has_backward(q) and not hooks_active()


def flex_forward_graph(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: DocSpans, scale: float
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
    """(out, lse, leaves, out_graph): as ``flex_forward``, run under autograd on detached leaves of q, k, v (views:
    no copies). ``out`` is ``out_graph`` detached (the same storage); ``torch.autograd.grad(out_graph, leaves, g)``
    is the dense backward without a second forward. The graph holds the leaves, the output and flex's own (log2)
    lse; ``lse`` (natural log) is a detached [b, h, s] fp32 tensor for the compact backward."""
    mask = block_mask(docs, q.device)
    with torch.enable_grad():
        leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
        out, lse = _flex(*leaves, mask, scale)
    return out.detach(), lse.detach(), leaves, out


def bias_rng(q: torch.Tensor, docs: DocSpans):
    """What the bias kernels' backward takes as the forward's random state (dropout is off: zeros), so the compact
    backward after a flex forward runs the bias path's kernel (cuDNN on CUDA at bf16/fp16, else memory-efficient;
    None on CPU)."""
    if not q.is_cuda:
        return None
    kind = "cudnn" if q.dtype in (torch.bfloat16, torch.float16) else "efficient"
    zero = docs.derived(("flex_rng", q.device), lambda: torch.zeros(1, dtype=torch.int64, device=q.device))
    return kind, zero, zero
