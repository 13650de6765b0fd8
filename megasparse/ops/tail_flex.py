"""FlexAttention for a ChunkFlow last chunk that holds packed short documents (``chunkflow.pack_tails``, decisions
1233 and 1239).

Such a chunk's rows [0, head) are a long sequence's tail, which sees the sequence's earlier chunks (the prefix: P
rotated keys/values from the ``PrefixSource``) and itself causally; the other rows are whole short documents, each
attending within itself. ``ops/prefix_attention.py`` runs that as two bias-masked kernels merged by log-sum-exp; here
it is ONE flex call: queries = the chunk's C rows, keys/values = prefix ++ the chunk's own (P + C), and a block mask
whose rule is "key < P: the query is a tail row; a key of the chunk's own: same document and causal". The softmax
runs over both parts at once, so there is no merge, and flex's own autograd gives dq and the gradients of the
concatenated keys/values, whose first P rows are the prefix's (only the tail's rows reach them, by the mask).

- *Mask.* Built on the device from ``DocSpans.segments`` and ``head`` (a device comparison, no host read),
  memoised on the chunk's spans for every layer (like ``doc_flex.block_mask``). Tables padded to whole tiles.
- *Compilation.* On CUDA the call and the mask builder are compiled (static shapes) through wrappers of their own,
  so their dynamo cache is not the packed chunks' (``doc_flex``). With ``width`` (ChunkFlow passes the keys of its
  longest sequence: n·C) the keys are laid out as prefix ++ zeros ++ own, always ``width`` long, and the prefix's
  length lives in a device tensor of the mask: ONE compiled variant for every P (decision 1248; the zero keys'
  tiles are empty in the block mask, so flex skips them). Without it, one variant per prefix length P (a multiple
  of C below the longest sequence: at most ``max_length / C − 1`` of them) and route. ``_room`` stops
  choosing flex for a new shape once dynamo's recompile limit would be reached (dynamo would then run flex
  eagerly, materialising the [C, P + C] scores); such a chunk runs the bias kernels. ``variant_keys`` names the
  variants of one chunk; every key asked for is recorded (``REQUESTED``, on CPU too), so ``chunkflow/tailwarm.py``
  can compile the ones a run's plan predicts before its first step and the tests can check the prediction
  (decision 1241); a key the warm-up did not predict is compiled when it comes, with one warning.
- *Backward.* As ``doc_flex`` (decision 1202): the forward's flex graph kept for the dense backward unless a
  saved-tensor hook is active (then flex runs again in the backward). Without a flex backward (CPU) the caller's
  bias kernels run with flex's output and lse, which are the merged ones. Collider's compact backward always takes
  the bias kernels (decision 1201's reason: the kept rows need the full softmax's lse).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from megasparse.ops import doc_flex
from megasparse.ops.documents import DocSpans

__all__ = [
    "REQUESTED",
    "WARMED",
    "backward",
    "block_mask",
    "chosen",
    "compiled_entries",
    "forward",
    "free_variants",
    "new_keys",
    "variant_keys",
    "width_for",
]

try:
    from torch.nn.attention.flex_attention import create_block_mask as _create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as _flex_attention
except ImportError:  # doc_flex.available() is False then, and so is ``chosen``
    _create_block_mask = _flex_attention = None


def _tail_flex_attention(q, k, v, **kw):
    """flex_attention under a name of its own: compiled, its cache (and recompile limit) is separate."""
    return _flex_attention(q, k, v, **kw)


def _tail_block_mask(mask_mod, q_len: int, kv_len: int, device):
    return _create_block_mask(mask_mod, 1, None, q_len, kv_len, device=device)


_FN: dict[str, Any] = {}
_SHAPES: set = set()
"""The compiled flex variants used so far on CUDA (shape, dtype, grad): bounded by ``_room``."""
REQUESTED: set = set()
"""Every variant key a chunk chose flex with, on any device (what the warm-up must predict; tests read it)."""
WARMED: set = set()
"""The keys ``chunkflow/tailwarm.py`` compiled before the first step (empty: no warm-up ran)."""


def _fns(cuda: bool):
    """(flex_attention, create_block_mask) for the tail: compiled once per process on CUDA, eager on CPU."""
    if not cuda:
        return _flex_attention, _tail_block_mask
    if "cuda" not in _FN:
        _FN["cuda"] = (
            torch.compile(_tail_flex_attention, dynamic=False),
            torch.compile(_tail_block_mask, dynamic=False),
        )
    return _FN["cuda"]


def _limit() -> int:
    cfg = torch._dynamo.config
    return int(getattr(cfg, "recompile_limit", getattr(cfg, "cache_size_limit", 8)))


def new_keys(keys: list[tuple]) -> list[tuple]:
    """Those of ``keys`` not compiled yet in this process."""
    return [k for k in keys if k not in _SHAPES]


def free_variants() -> int:
    """How many more compiled variants fit under dynamo's recompile limit (the warm-up's budget)."""
    return max(0, _limit() - len(_SHAPES))


def compiled_entries() -> list[int] | None:
    """Dynamo's cache entries of the flex call's and the mask builder's wrappers (what was really compiled: the
    benchmark compares it with the warm-up's count); None where this torch cannot say."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list as entries

        return [len(entries(f.__code__)) for f in (_tail_flex_attention, _tail_block_mask)]
    except Exception:  # noqa: BLE001 - a private helper: a diagnostic only
        return None


def _room(keys: list[tuple]) -> bool:
    """Whether every compiled variant ``keys`` names is compiled already or still fits under dynamo's recompile
    limit (then they are counted as compiled). One warning the first time a chunk is refused."""
    new = new_keys(keys)
    if len(_SHAPES) + len(new) > _limit():
        if not _FN.get("warned"):
            _FN["warned"] = True
            warnings.warn(
                f"megasparse: a packed last chunk of a new prefix length ({keys[0][1]} keys) would pass dynamo's "
                f"recompile limit ({_limit()} FlexAttention variants); such chunks run the bias kernels",
                stacklevel=3,
            )
        return False
    _SHAPES.update(new)
    return True


def width_for(chunk: int, prefix: int, width: int | None) -> int | None:
    """The keys' padded length for a chunk of ``chunk`` rows after ``prefix`` keys: ``width``, or None (unpadded:
    P + C) where there is none or the chunk would not fit in it (a sequence longer than the run was sized for)."""
    return width if width is not None and prefix + chunk <= width else None


def chosen(docs: DocSpans, q: torch.Tensor, prefix: int, keep: bool, width: int | None = None) -> bool:
    """Whether the packed last chunk of ``q`` runs on flex: ``docs.kernel`` decides as for every document attention
    (``doc_flex.chosen``: ``auto`` is flex on CUDA at bf16/fp16), and on CUDA its compiled variants must fit
    (``_room``); ``keep``: the forward keeps flex's graph (one variant) rather than rerunning it (two); ``width``:
    the keys padded to that length (one variant for every prefix)."""
    if not doc_flex.chosen(docs.kernel, q):
        return False
    keys = variant_keys(q.shape, prefix, q.dtype, keep, width)
    REQUESTED.update(keys)
    if not q.is_cuda:
        return True
    late = [k for k in keys if WARMED and k not in WARMED and k not in _SHAPES]
    if late and not _FN.get("late"):
        _FN["late"] = True
        warnings.warn(
            f"megasparse: a packed last chunk needs a FlexAttention variant the warm-up did not predict (prefix "
            f"{prefix}): compiling it inside this step",
            stacklevel=3,
        )
    return _room(keys)


def variant_keys(
    q_shape: tuple[int, ...], prefix: int, dtype: torch.dtype, keep: bool, width: int | None = None
) -> list[tuple]:
    """The compiled variants a packed last chunk with queries of ``q_shape`` [b, h, C, d] and a prefix of ``prefix``
    keys runs: (q's shape, the keys' length: ``width`` or P + C, dtype, under grad); ``keep`` (the forward keeps
    flex's graph): one, under grad; else the forward's without grad and the backward's rerun under grad."""
    shape = (tuple(q_shape), width_for(q_shape[2], prefix, width) or q_shape[2] + prefix)
    return [(*shape, dtype, True)] if keep else [(*shape, dtype, False), (*shape, dtype, True)]


def _rule(start: int, tail: torch.Tensor, pre: torch.Tensor, qseg: torch.Tensor, kseg: torch.Tensor):
    """The mask_mod: a key before ``start`` is the prefix's, seen by the tail's rows (``tail[q]``) where it is a real
    one (``pre[k]``: false on the zero keys that pad the prefix to a fixed width); a key from ``start`` on is the
    chunk's own, seen by the rows of its document at or after it. Everything that varies per chunk is a device
    tensor, so one compiled variant serves every prefix. (A function of its own: the tests swap it for broken rules.)"""

    def tail_and_documents(b, h, qi, ki):
        own = ki >= start
        return (~own & tail[qi] & pre[ki]) | (own & (ki - start <= qi) & (qseg[b, qi] == kseg[b, ki]))

    return tail_and_documents


def block_mask(docs: DocSpans, head: int, prefix: int, device: torch.device, width: int | None = None):
    """The chunk's BlockMask over prefix ++ (zeros up to ``width``) ++ own keys, built once per chunk forward
    (memoised on ``docs``)."""
    s = docs.segments.shape[0]
    width = width_for(s, prefix, width) or prefix + s
    start = width - s  # the chunk's own keys

    def build():
        b = docs.segments.shape[1]
        qw, kw = (-(-n // doc_flex.BLOCK) * doc_flex.BLOCK for n in (s, width))
        qseg = docs.segments.new_full((b, qw), -1)
        qseg[:, :s] = docs.segments.t()
        kseg = docs.segments.new_full((b, kw), -2)  # never a query's: the prefix is ruled by ``tail`` and ``pre``
        kseg[:, start:width] = docs.segments.t()
        dev = docs.segments.device
        tail = torch.arange(qw, device=dev) < head  # on the device: no host read
        pre = torch.arange(kw, device=dev) < prefix
        fn = _fns(device.type == "cuda")[1]
        return fn(_rule(start, tail, pre, qseg, kseg), s, width, device)

    return docs.derived(("tail_flex_mask", head, prefix, width, device.type), build)


def _keys(pre, k: torch.Tensor, v: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """prefix ++ zeros ++ own keys and values [b, nkv, ``width``, d] (new tensors: the prefix's store is not
    written)."""
    if pre is None and width == k.shape[2]:
        return k.contiguous(), v.contiguous()
    out = []
    for p, x in ((None if pre is None else pre[0], k), (None if pre is None else pre[1], v)):
        parts = [] if p is None else [p]
        gap = width - x.shape[2] - (0 if p is None else p.shape[2])
        if gap:
            parts.append(x.new_zeros(*x.shape[:2], gap, x.shape[3]))
        out.append(torch.cat([*parts, x], 2))
    return out[0], out[1]


def _under_grad(q, k, v, pre, mask, scale: float, width: int):
    """(out, lse, leaves): flex under autograd on detached leaves (q, prefix ++ k, prefix ++ v)."""
    kc, vc = _keys(pre, k.detach(), v.detach(), width)
    leaves = (q.detach().requires_grad_(), kc.requires_grad_(), vc.requires_grad_())
    with torch.enable_grad():
        out, lse = doc_flex._flex(*leaves, mask, scale, _fns(q.is_cuda)[0])
    return out, lse, leaves


def _layout(q: torch.Tensor, pre, width: int | None) -> tuple[int, int]:
    """(P, the keys' length): the prefix's keys and the padded (or exact) length of prefix ++ own."""
    prefix = 0 if pre is None else pre[0].shape[2]
    return prefix, width_for(q.shape[2], prefix, width) or prefix + q.shape[2]


def forward(q, k, v, pre, docs: DocSpans, head: int, scale: float, keep: bool, width: int | None = None):
    """(out [b, h, C, d], lse [b, h, C] natural log, k_out, v_out [b, nkv, C, d], graph): attention of the chunk's
    rows ``q`` over ``pre`` (the prefix's (k, v) or None) ++ its own ``k``, ``v``. ``keep``: run under autograd on
    detached leaves and return (leaves, output) as ``graph`` for ``backward`` (else None); k_out/v_out then are views
    of the concatenated leaves (no second copy of the chunk's keys/values), else contiguous copies. ``width``: the
    concatenated keys padded with zeros between prefix and own to that length (one compiled variant per run)."""
    prefix, w = _layout(q, pre, width)
    mask = block_mask(docs, head, prefix, q.device, width)
    if not keep:
        kc, vc = _keys(pre, k.detach(), v.detach(), w)
        out, lse = doc_flex._flex(q.detach(), kc, vc, mask, scale, _fns(q.is_cuda)[0])
        return out, lse, k.contiguous(), v.contiguous(), None
    out, lse, leaves = _under_grad(q, k, v, pre, mask, scale, w)
    k_out, v_out = (t.detach()[:, :, w - q.shape[2] :] for t in leaves[1:])
    return out.detach(), lse.detach(), k_out, v_out, (leaves, out)


def backward(go, graph, q, k, v, pre, docs: DocSpans, head: int, scale: float, width: int | None = None):
    """(dq, dk, dv, dk_prefix, dv_prefix) of the dense backward (the prefix's None without a prefix): through
    ``graph`` (the forward's), or by running flex again under autograd on the saved q, k, v and ``pre``."""
    prefix, w = _layout(q, pre, width)
    if graph is None:
        out, _, leaves = _under_grad(q, k, v, pre, block_mask(docs, head, prefix, q.device, width), scale, w)
        graph = (leaves, out)
    dq, dkc, dvc = torch.autograd.grad(graph[1], graph[0], go)
    own = w - q.shape[2]
    if pre is None:
        return dq, dkc[:, :, own:], dvc[:, :, own:], None, None
    return dq, dkc[:, :, own:], dvc[:, :, own:], dkc[:, :, :prefix], dvc[:, :, :prefix]
