"""One group's chunks (a long sequence's, in causal order) forward and backward, with the keys/values between them.

Forward: chunk j runs with ``ChunkKV`` handed to the model; each layer's attention (``ops/prefix_attention.py``)
reads the rotated keys/values of chunks < j from this group's ``KVStore`` and writes its own. Only the last K
chunks (``max_chunks_in_memory``) keep their autograd graphs; the earlier ones run under ``no_grad`` and leave only
their keys/values.

Backward, in reverse chunk order: chunk j's graph (kept, or rebuilt by running its forward again, which is
deterministic and reads the same prefix) is differentiated from its loss *and* from its keys/values, whose incoming
gradients are what chunks > j added into the store's gradient buffers. Its own attention adds the gradients of the
prefix keys/values into those buffers in turn. One ``autograd.backward`` per chunk: each parameter's gradient
arrives once per chunk, which is what the DP buckets' overlap hooks count (decision 1222).

Under ``filter.mode=collider`` (decision 1223) each chunk's kept positions are recorded here at its first forward
(``ChunkKV.keep_rows``); a later chunk's compact backward reads the earlier chunks' kept keys/values only and adds
gradients into those rows only, so the gradient buffers hold nothing at the other rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megasparse.chunkflow.schedule import ChunkId, Op, Schedule
from megasparse.ops.documents import DocSpans
from megasparse.ops.prefix_attention import prefix_attention
from megasparse.parallel import comm
from megasparse.parallel.pipeline import FreeSends, StageComm, catch_grad

__all__ = ["ChunkKV", "KVStore", "run_group", "run_schedule"]


class KVStore:
    """Every layer's rotated keys/values of one group's chunks, and their gradients from later chunks.

    Per layer one buffer [b, nkv, n·C, d] each for k and v (allocated at the first chunk's write) and for dk, dv
    (at the first gradient a later chunk's backward sends: a sequence forwarding beside another one's backwards holds
    no gradient buffers yet, decision 1249): chunk j's prefix is a view of its first j·C positions, so nothing is
    copied per chunk. The gradients accumulate in fp32 (bf16 k/v receive a sum over up to n − 1 later chunks)."""

    def __init__(self, num_chunks: int, chunk_size: int):
        self.n, self.c = num_chunks, chunk_size
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.dk: dict[int, torch.Tensor] = {}
        self.dv: dict[int, torch.Tensor] = {}
        self.kept: dict[int, torch.Tensor] = {}
        """Collider: chunk j's kept positions in the sequence (ascending), recorded at its first forward."""
        self._prefix_kept: dict[int, torch.Tensor] = {}

    def prefix_kept(self, j: int) -> torch.Tensor | None:
        """The kept positions of chunks < j (None: no selection recorded, every position trains)."""
        if not self.kept:
            return None
        if j not in self._prefix_kept:  # shared by every layer of chunk j's backward
            self._prefix_kept[j] = torch.cat([self.kept[i] for i in range(j)])
        return self._prefix_kept[j]

    def write(self, layer: int, j: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if layer not in self.k:
            shape = (k.shape[0], k.shape[1], self.n * self.c, k.shape[3])
            for store in (self.k, self.v):
                store[layer] = k.new_empty(shape)
        lo = j * self.c
        self.k[layer][:, :, lo : lo + self.c].copy_(k)
        self.v[layer][:, :, lo : lo + self.c].copy_(v)

    def grads_of(self, layer: int, j: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What chunks > j sent to chunk j's keys/values (None for the last chunk: nothing comes after it)."""
        if j == self.n - 1 or layer not in self.dk:  # none came (a packed tail whose rows all went unkept)
            return None
        lo = j * self.c
        return self.dk[layer][:, :, lo : lo + self.c], self.dv[layer][:, :, lo : lo + self.c]

    def grad_buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's dk, dv, zeroed at the first call (the sequence's first backward that reaches its prefix)."""
        if layer not in self.dk:
            k = self.k[layer]
            acc = torch.promote_types(k.dtype, torch.float32)  # summed over every later chunk
            for store in (self.dk, self.dv):
                store[layer] = torch.zeros(k.shape, dtype=acc, device=k.device)
        return self.dk[layer], self.dv[layer]


class _LayerPrefix:
    """``ops.prefix_attention.PrefixSource`` of one layer for chunk j: the store's first j·C positions."""

    def __init__(self, store: KVStore, layer: int, j: int):
        self.store, self.layer, self.j = store, layer, j

    def prefix(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.j == 0:
            return None
        hi = self.j * self.store.c
        return self.store.k[self.layer][:, :, :hi], self.store.v[self.layer][:, :, :hi]

    def kept(self) -> torch.Tensor | None:
        return self.store.prefix_kept(self.j)

    def add_grad(self, dk: torch.Tensor, dv: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        hi = self.j * self.store.c
        for buf, grad in zip(self.store.grad_buffers(self.layer), (dk, dv)):
            if rows is None:
                buf[:, :, :hi].add_(grad)
            else:  # the compact backward: only the earlier chunks' kept rows receive anything
                buf.index_add_(2, rows, grad.to(buf.dtype))


class ChunkKV:
    """What the model gets for chunk j of a group (``GPTStage.forward(..., kv=)``): the RoPE offset of its first
    token and, per layer, the attention over the earlier chunks. ``rerun``: the forward runs again for the
    backward (the store already holds this chunk's keys/values). ``pack``: a last chunk that also holds short
    documents (decision 1233)."""

    def __init__(self, store: KVStore, j: int, offset: int, rerun: bool = False):
        self.store, self.j, self.offset, self.rerun = store, j, offset, rerun
        self.docs: DocSpans | None = None
        self.head: int | None = None
        self.width: int | None = None
        self.outputs: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        """(layer, k, v) of this chunk with their autograd history (forwards with grad only)."""

    def pack(self, docs: DocSpans, head: int, width: int | None = None) -> None:
        """This chunk's rows [0, head) are the sequence's tail, the rest packed documents (``docs``: all of the
        chunk's documents and RoPE positions, the tail's from ``offset``): only the tail attends to the prefix.
        ``width``: flex's keys padded to it (one compiled variant for every prefix; ``ops/tail_flex.py``)."""
        self.docs, self.head, self.width = docs, head, width

    def keep_rows(self, positions: torch.Tensor) -> None:
        """Collider: this chunk's kept positions (ascending, in the chunk), which the later chunks' compact
        backwards reach in its keys/values."""
        self.store.kept[self.j] = positions + self.j * self.store.c

    def attend(self, layer: int, qkv: torch.Tensor, nq: int, nkv: int, cos, sin, bias=None) -> torch.Tensor:
        """Layer ``layer``'s attention for this chunk: y [s, b, nq·d] (its keys/values recorded)."""
        source = _LayerPrefix(self.store, layer, self.j)
        y, k, v = prefix_attention(qkv, nq, nkv, cos, sin, self.offset, source, bias, self.docs, self.head, self.width)
        if not self.rerun:
            self.store.write(layer, self.j, k.detach(), v.detach())
        if torch.is_grad_enabled():
            self.outputs.append((layer, k, v))
        return y


Forward = Callable[[int, torch.Tensor | None, ChunkKV, bool], torch.Tensor]
"""``forward(j, x, kv, first)``: chunk j through this stage from its input ``x`` (None on the first stage): the
stage output, or on the last stage the scalar training loss; ``first`` is False on a rerun for the backward (the
caller must not count its loss twice)."""


def _entry(x: torch.Tensor | None, holder: dict) -> torch.Tensor | None:
    """The received input with its gradient caught for the send upstream (None on the first stage)."""
    return None if x is None else catch_grad(x.requires_grad_(), holder)


def run_group(forward: Forward, offsets: list[int], chunk_size: int, keep: int) -> None:
    """Chunks of one group on one stage: forward in order, backward in reverse; at most ``keep`` (K >= 1) keep
    their graphs from the forward, the others rerun theirs just before their backward. (Through the pipeline
    every stage runs its row of a slot table instead: ``run_schedule``.)"""
    n = len(offsets)
    store = KVStore(n, chunk_size)
    live: dict[int, tuple[torch.Tensor, ChunkKV]] = {}
    for j in range(n):
        kv = ChunkKV(store, j, offsets[j])
        if j >= n - keep:
            live[j] = (forward(j, None, kv, True), kv)
        else:
            with torch.no_grad():
                forward(j, None, kv, True)
    for j in reversed(range(n)):
        if j in live:
            out, kv = live.pop(j)
        else:
            kv = ChunkKV(store, j, offsets[j], rerun=True)
            out = forward(j, None, kv, False)
        torch.autograd.backward(*_roots(store, j, kv, out, None))
        del out, kv  # this chunk's graph goes now: memory follows K, not the group's length


def _roots(store: KVStore | None, j: int, kv: ChunkKV | None, out: torch.Tensor, g: torch.Tensor | None):
    """Chunk j's one ``autograd.backward``'s roots: its output (gradient ``g``; None: the loss) and its keys/values,
    whose gradients the later chunks left in the store."""
    outs, grads = [out], [g]
    for layer, k, v in kv.outputs if kv is not None else []:
        kv_grad = store.grads_of(layer, j)
        if kv_grad is not None:
            outs += [k, v]
            grads += [kv_grad[0].to(k.dtype), kv_grad[1].to(v.dtype)]
    return outs, grads


def _backward(store: KVStore | None, j: int, kv: ChunkKV | None, out: torch.Tensor, g: torch.Tensor | None) -> None:
    """Chunk j's backward on a pipeline stage (its transfers tagged as the backward's)."""
    with comm.phase("backward"):
        torch.autograd.backward(*_roots(store, j, kv, out, g))


def _kept_of(store: KVStore, n: int) -> torch.Tensor:
    """A group's kept positions, chunk after chunk (what the last stage chose, or received from the next)."""
    return torch.cat([store.kept[j] for j in range(n)])


def run_schedule(
    plan: Schedule,
    stage: int,
    forwards: list[Forward],
    offsets: list[list[int]],
    chunk_size: int,
    p2p: StageComm,
    kept: list[list[int]] | None = None,
    free_sends: bool = False,
) -> None:
    """This pipeline stage's slots of ``plan`` (``schedule.py``): group g's chunk j runs ``forwards[g]`` at
    ``offsets[g][j]``, a long group's chunks over its ``KVStore`` (one per group, dropped after its chunk 0's
    backward), an independent chunk (a group of one) with no state.

    At each boundary the stage posts in one batch (``StageComm.send_recv``) what ``plan.transfers`` names: the
    output of the forward and the input gradient of the backward it finished in the slot before go out, what the
    neighbours finished then comes in and waits, filed by chunk, until its slot (an op runs when the stage reaches
    its start slot; what it produces waits for the boundary after its last slot). Forwards keep their graphs for
    chunks ``plan.kept`` says; the others keep their received input and run forward again in their backward's slot
    (no transfer repeated).

    ``kept`` (collider, decision 1223): each chunk's kept count, from the plan. Each compact gradient's receive
    posts its chunk's count; a long group's kept positions, chosen on the last stage in its forwards, cross every
    boundary with the gradient of the group's first backward (``Schedule.opens``), so an earlier stage's compact
    backward of chunk j reads the kept rows of chunks < j.

    ``free_sends`` (dense gradients, a table built with ``schedule.COST``; decision 1249): the boundary's sends go
    out without waiting for their receivers (``pipeline.FreeSends``) and only its receives wait, for their data."""
    assert not (free_sends and kept is not None), "collider's compact gradients cross in rendezvous batches"
    free = FreeSends(p2p) if free_sends else None
    stores: dict[int, KVStore] = {}
    now = [0]  # the kept count of the gradient received at this boundary
    if kept is not None:
        p2p.spec.kept_rows, p2p.spec.seq_count, p2p.spec.shards = lambda: now[0], None, 1
    live: dict[ChunkId, tuple[torch.Tensor, ChunkKV | None, dict]] = {}
    inputs: dict[ChunkId, torch.Tensor | None] = {}  # received, waiting for the forward (or kept for the rerun)
    grads: dict[ChunkId, torch.Tensor] = {}
    outgoing: dict[Op, torch.Tensor | None] = {}  # produced, waiting for the boundary that sends it
    for t in range(plan.length + 1):
        send_x, recv_x, send_g, recv_g = plan.transfers(stage, t)
        y = None if send_x is None else outgoing.pop(("F", send_x))
        gin = None if send_g is None else outgoing.pop(("B", send_g))
        if free is not None:  # sends first: they never wait; then the receives, which do
            if y is not None:
                free.send_forward(y)
            if gin is not None:
                free.send_backward(gin)
            x = free.recv_forward() if recv_x is not None else None
            g = free.recv_backward() if recv_g is not None else None
        elif kept is None:
            x, g = p2p.send_recv(y, recv_x is not None, gin, recv_g is not None)
        else:
            out_kept = _kept_of(stores[send_g[0]], plan.sizes[send_g[0]]) if plan.opens(send_g) else None
            want = sum(kept[recv_g[0]]) if plan.opens(recv_g) else None
            now[0] = 0 if recv_g is None else kept[recv_g[0]][recv_g[1]]
            x, g, idx = p2p.send_recv_kept(y, recv_x is not None, gin, recv_g is not None, out_kept, want)
            if idx is not None:
                store = stores.setdefault(recv_g[0], KVStore(plan.sizes[recv_g[0]], chunk_size))
                store.kept, store._prefix_kept = dict(enumerate(idx.split(kept[recv_g[0]]))), {}
        if recv_x is not None:
            inputs[recv_x] = x
        if recv_g is not None:
            grads[recv_g] = g
        op = plan.at(stage, t)
        if op is None:
            continue
        kind, c = op
        gi, j = c
        n = plan.sizes[gi]
        if n > 1 and gi not in stores:
            stores[gi] = KVStore(n, chunk_size)
        if kind == "F":
            kv = ChunkKV(stores[gi], j, offsets[gi][j]) if n > 1 else None
            x = inputs.pop(c, None)
            if plan.kept(c):
                holder: dict = {}
                out = forwards[gi](j, _entry(x, holder), kv, True)
                live[c] = (out, kv, holder)
            else:
                with torch.no_grad():
                    out = forwards[gi](j, x, kv, True)
                inputs[c] = x
            if stage < plan.pp - 1:
                outgoing[op] = out.detach()
            del out
            continue
        if c in live:
            out, kv, holder = live.pop(c)
        else:
            holder = {}
            kv = ChunkKV(stores[gi], j, offsets[gi][j], rerun=True)
            out = forwards[gi](j, _entry(inputs.pop(c), holder), kv, False)
        _backward(stores.get(gi), j, kv, out, grads.pop(c, None))
        if stage > 0:
            outgoing[op] = holder.get("grad")
        if j == 0:
            stores.pop(gi, None)  # the group's last backward on this stage: its keys/values go
        del out, kv, holder  # this chunk's graph goes now
    if free is not None:
        free.settle()
    assert not live and not grads and not outgoing, "the schedule left chunks without their backward or send"
