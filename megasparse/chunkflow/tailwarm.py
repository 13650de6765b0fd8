"""Compiling the packed last chunks' FlexAttention variant before the first step (``chunkflow.pack_tails`` on flex,
decisions 1239, 1241 and 1248).

On CUDA ``ops/tail_flex.py`` compiles a flex variant (forward, its backward and the block-mask builder: tens of
seconds to minutes of host time) per shape of a packed last chunk's keys. ChunkFlow pads those keys to its longest
sequence's chunks (``tail_width``), so every prefix length P shares one variant; where the longest sequence is
unknown each P is its own. Found lazily, those compiles land inside training steps: a silent stall of minutes, and a
benchmark that times compilation. The plan is host-side and cheap (``plan.py``), so the variants are known before any
model runs: ``tail_prefixes`` walks every DP rank's plans over the steps that will run and collects each packed last
chunk's P (its ``offset``: the keys of the earlier chunks), and ``warm_tails`` runs one packed last chunk per
distinct variant through ``prefix_attention`` forward and backward with the stage's own shapes, dtype and RoPE
tables, so the compiled entries are the ones the steps hit. On CPU flex runs eagerly: the keys are computed (and
returned) but nothing runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from megasparse.chunkflow.data import longest_sequence
from megasparse.chunkflow.plan import Chunk, Piece, plan_step
from megasparse.ops import doc_flex, tail_flex
from megasparse.ops.prefix_attention import prefix_attention
from megasparse.parallel.state import log0

__all__ = ["HORIZON", "predicted_keys", "tail_prefixes", "tail_width", "warm_tails"]

HORIZON = 2000
"""Steps planned at most (~1 ms each at 137 sequences); the walk stops earlier once every possible P was seen."""


def _lengths(source, step: int, n: int) -> list[int]:
    """The step's sequence lengths without reading tokens where the source can say them."""
    if hasattr(source, "step_lengths"):
        return [int(x) for x in source.step_lengths(step, n)]
    if hasattr(source, "length"):
        return [source.length(g) for g in range(step * n, step * n + n)]
    return [len(t) for _, t in source.step_sequences(step, n)]


def _chunks_of_longest(source, chunk_size: int, max_length: int | None) -> int | None:
    """Chunks of the longest sequence the run can meet (its predictions: tokens - 1); None: unknown."""
    longest = longest_sequence(source, max_length)
    return None if longest is None else max(1, -(-(longest - 1) // chunk_size))


def _possible(source, chunk_size: int, max_length: int | None) -> int | None:
    """How many prefix lengths a packed last chunk can have: (chunks of the longest sequence) - 1."""
    n = _chunks_of_longest(source, chunk_size, max_length)
    return None if n is None else n - 1


def tail_width(source, chunk_size: int, max_length: int | None) -> int | None:
    """The keys a packed last chunk's flex call is padded to: the longest sequence's chunks times the chunk size
    (its last chunk's prefix and itself), so one compiled variant serves every P (``tail_flex``); None: unknown."""
    n = _chunks_of_longest(source, chunk_size, max_length)
    return None if n is None else n * chunk_size


def tail_prefixes(cf, steps: range) -> dict[int, int]:
    """{P: packed last chunks} of every DP rank (``cf``: the ``ChunkFlowStep``) over ``steps`` (the first
    ``HORIZON``), in order of first appearance; the counts are of the steps walked (the walk stops once every
    possible P was seen). Every rank's, not this rank's alone: each then compiles the same variants (tens of seconds
    each), so no rank waits minutes in the first step's collective for a slower one, and every rank runs the same
    kernel for a given P."""
    if not (cf.pack and cf.pack_tails):
        return {}
    possible = _possible(cf.source, cf.c, cf.max_length)
    found: dict[int, int] = {}
    for s in steps[:HORIZON]:
        plan = plan_step(_lengths(cf.source, s, cf.per_step), cf.c, cf.dp, True, cf.max_length, True)
        for g in (g for r in range(cf.dp) for g in plan.rank_groups(r)):
            last = g.chunks[-1]
            if len(g.chunks) > 1 and len(last.pieces) > 1:  # what ``ChunkFlowStep`` hands ``ChunkKV.pack``
                found[last.offset] = found.get(last.offset, 0) + 1
        if possible is not None and len(found) >= possible:
            break
    return found


def _attention(cf):
    """The stage's first attention module (None: a stage without layers) and the compute dtype of its q/k/v."""
    layers = getattr(cf.stage, "layers", None)
    if not layers:
        return None, None
    attn = layers[0].attn
    return attn, attn.qkv.compute_dtype


def predicted_keys(cf, prefixes) -> list[tuple]:
    """``tail_flex.variant_keys`` of every P in ``prefixes`` on this stage (empty where flex is not chosen: the
    ``bias`` kernel, or ``auto`` at fp32 or on CPU). The route as the steps take it: the last chunk is always among
    the K kept ones and ChunkFlow refuses full recompute, so it keeps flex's graph wherever torch has a flex
    backward (``doc_flex.keeps_graph``)."""
    attn, dtype = _attention(cf)
    if attn is None or not prefixes:
        return []
    q = torch.empty(0, device=cf.device, dtype=dtype)
    if not doc_flex.chosen(cf.doc_kernel, q):
        return []
    keep = doc_flex.keeps_graph(q, True)
    shape = (1, attn.nq, cf.c, cf.stage.cfg.head_dim)
    width = cf.tail_width
    return list(dict.fromkeys(k for p in prefixes for k in tail_flex.variant_keys(shape, p, dtype, keep, width)))


class _Prefix:
    """A ``PrefixSource`` of zeros laid out as the ``KVStore``'s (views of a longer buffer); drops gradients."""

    def __init__(self, buf: torch.Tensor, prefix: int):
        self.k, self.v = buf[0][:, :, :prefix], buf[1][:, :, :prefix]

    def prefix(self):
        return self.k, self.v

    def kept(self):
        return None

    def add_grad(self, dk, dv, rows=None) -> None:
        pass


def _one(cf, attn, dtype, prefix: int) -> None:
    """One packed last chunk (a tail and one document) at ``prefix`` through this stage's attention path, forward
    and backward, on zeros: the compiles its steps will hit (no parameter, store or random state touched)."""
    c, d, dev, nq, nkv = cf.c, cf.stage.cfg.head_dim, cf.device, attn.nq, attn.nkv
    head = max(1, c // 2)
    chunk = Chunk([Piece(0, prefix, head), Piece(1, 0, max(1, (c - head) // 2))], offset=prefix)
    docs = cf.tail_spans(chunk, [0, head])  # as the step's forward makes them
    cos, sin = cf.stage.rope(c + prefix)  # the tables the chunk's forward takes
    qkv = torch.zeros(c, 1, (nq + 2 * nkv) * d, device=dev, dtype=dtype, requires_grad=True)
    buf = torch.zeros(2, 1, nkv, prefix + c, d, device=dev, dtype=dtype)
    y, _, _ = prefix_attention(qkv, nq, nkv, cos, sin, prefix, _Prefix(buf, prefix), None, docs, head, cf.tail_width)
    y.backward(torch.zeros_like(y))


def warm_tails(cf, steps: range, log: Callable[[str], None] = log0, run: bool | None = None) -> dict | None:
    """Compile, before ``steps`` run, the tail-flex variants every DP rank's plans need (``cf``: the ``ChunkFlowStep``;
    None: ChunkFlow off). Returns (and keeps as ``cf.tail_warmup``) ``tail_prefixes`` (P), ``tail_width`` (the keys'
    padded length; None: one variant per P), ``tail_variants`` (compiled dynamo entries of the flex call: one per
    distinct key shape on the kept-graph route), ``tail_compile_s`` and ``tail_skipped`` (P past dynamo's recompile
    limit: those chunks run the bias kernels). ``run``: run one synthetic chunk per variant (None: on CUDA only; on
    CPU flex is eager and there is nothing to compile)."""
    if cf is None:
        return None
    t0 = time.perf_counter()
    prefixes = sorted(tail_prefixes(cf, steps))
    shared: dict[tuple, list[int]] = {}  # a variant's keys -> the P it serves (padded: every P, one entry)
    for p in prefixes:
        shared.setdefault(tuple(predicted_keys(cf, [p])), []).append(p)
    per = max((len(k) for k in shared), default=0)
    fresh = [k for k in shared if k and tail_flex.new_keys(list(k))]  # not compiled yet (an earlier run)
    room = tail_flex.free_variants() // max(per, 1)
    todo, over = fresh[:room], fresh[room:]
    skipped = sorted(p for k in over for p in shared[k])
    done = [k for k in shared if k and k not in over]
    width = cf.tail_width if cf.pack and cf.pack_tails else None
    rec = {"tail_prefixes": prefixes, "tail_width": width, "tail_variants": sum(map(len, done)),
           "tail_compile_s": 0.0, "tail_skipped": skipped, "tail_plan_s": time.perf_counter() - t0}  # fmt: skip
    cf.tail_warmup = rec
    if not todo or not (cf.device.type == "cuda" if run is None else run):  # eager flex on CPU: nothing to compile
        return rec
    attn, dtype = _attention(cf)
    served = ",".join(str(p) for k in todo for p in shared[k])
    pad = f"; keys padded to {width}" if width else ""
    what = f"{len(todo)} FlexAttention tail variant{'s' * (len(todo) > 1)} (P={served}{pad})"
    log(f"chunkflow: compiling {what} for steps {steps.start}-{steps.stop - 1}: 0/{len(todo)}")
    t0 = time.perf_counter()
    for i, k in enumerate(todo, 1):
        try:
            _one(cf, attn, dtype, shared[k][0])
        except torch.OutOfMemoryError:  # not flex's fault: the bias kernels would need more memory still
            raise
        except Exception as e:  # noqa: BLE001 - as a step's flex call: flex off for the process, the bias kernels
            doc_flex.flex_failed(e, torch.empty(0, device=cf.device))
            break
        if cf.device.type == "cuda":
            torch.cuda.synchronize(cf.device)
        log(f"chunkflow: compiling {what}: {i}/{len(todo)}, {time.perf_counter() - t0:.1f} s")
    tail_flex.WARMED.update(x for k in done for x in k)
    if skipped:
        log(f"chunkflow: P={','.join(map(str, skipped))} pass dynamo's recompile limit: those chunks run the bias")
    rec["tail_compile_s"] = time.perf_counter() - t0
    return rec
