"""The one place megasparse talks to torch.distributed.

Every collective and P2P transfer goes through these wrappers, so the communication profiler
(`megasparse profile-comm`) sees exactly the tensors that are sent, padding included, with their
phase (forward/backward), kind, group and region. Wrappers run under gloo and NCCL alike.
"""

from __future__ import annotations

import contextlib
import time
import types
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

# Process-wide, not thread-local: on CUDA autograd runs backward Functions on its own device thread, and their
# collectives must still see the recorder and the phase that the training loop set around ``backward()``.
_state = types.SimpleNamespace()


@dataclass
class CommRecord:
    """One transfer as it happened on this rank."""

    phase: str
    """forward, backward, or optim (parameter-sized traffic such as DP gradient reduction)."""
    kind: str
    """all_reduce, all_gather, reduce_scatter, send, recv, broadcast."""
    group: str
    """tp, pp, dp, world, ... (the name given to the call)."""
    region: str
    """Where in the model, e.g. layer3.attn.out_proj, or pipeline."""
    numel: int
    dtype: str
    bytes: int
    duration_ms: float | None = None
    step: int = -1

    def as_dict(self) -> dict:
        return asdict(self)


class CommRecorder:
    """Collects CommRecords while active (see ``recording``)."""

    def __init__(self, time_on_gpu: bool = False):
        self.records: list[CommRecord] = []
        self.time_on_gpu = time_on_gpu
        self.step = -1


def _recorder() -> CommRecorder | None:
    return getattr(_state, "recorder", None)


def _phase() -> str:
    return getattr(_state, "phase", "forward")


@contextlib.contextmanager
def recording(recorder: CommRecorder) -> Iterator[CommRecorder]:
    prev = _recorder()
    _state.recorder = recorder
    try:
        yield recorder
    finally:
        _state.recorder = prev


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Tag transfers issued inside with ``name`` (forward/backward/optim)."""
    prev = _phase()
    _state.phase = name
    try:
        yield
    finally:
        _state.phase = prev


@contextlib.contextmanager
def region(name: str) -> Iterator[None]:
    prev = getattr(_state, "region", "")
    _state.region = name
    try:
        yield
    finally:
        _state.region = prev


def current_region() -> str:
    return getattr(_state, "region", "")


def _record(kind: str, group_name: str, t: torch.Tensor, region_name: str | None, t0: float | None) -> None:
    rec = _recorder()
    if rec is None:
        return
    dur = None
    if t0 is not None:
        if t.is_cuda:
            torch.cuda.synchronize(t.device)
        dur = (time.perf_counter() - t0) * 1e3
    rec.records.append(
        CommRecord(
            phase=_phase(),
            kind=kind,
            group=group_name,
            region=region_name if region_name is not None else current_region(),
            numel=t.numel(),
            dtype=str(t.dtype).replace("torch.", ""),
            bytes=t.numel() * t.element_size(),
            duration_ms=dur,
            step=rec.step,
        )
    )


def _t0(t: torch.Tensor) -> float | None:
    rec = _recorder()
    if rec is None or not (rec.time_on_gpu and t.is_cuda):
        return None
    torch.cuda.synchronize(t.device)
    return time.perf_counter()


def world_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def all_reduce(
    t: torch.Tensor,
    group,
    group_name: str,
    op=dist.ReduceOp.SUM,
    region: str | None = None,
    async_op: bool = False,
):
    """In-place all-reduce; returns a work handle when ``async_op``."""
    if world_size(group) == 1:
        return None
    t0 = _t0(t)
    work = dist.all_reduce(t, op=op, group=group, async_op=async_op)
    _record("all_reduce", group_name, t, region, t0)
    return work


def all_gather(t: torch.Tensor, group, group_name: str, dim: int = 0, region: str | None = None) -> torch.Tensor:
    """Concatenate equal-shaped ``t`` from every rank along ``dim``."""
    n = world_size(group)
    if n == 1:
        return t
    t = t.contiguous()
    t0 = _t0(t)
    if dim == 0:
        out = torch.empty((n * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        if t.is_cuda:
            dist.all_gather_into_tensor(out, t, group=group)
        else:
            dist.all_gather(list(out.chunk(n)), t, group=group)
    else:
        parts = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(parts, t, group=group)
        out = torch.cat(parts, dim=dim)
    _record("all_gather", group_name, t, region, t0)
    return out


def reduce_scatter(t: torch.Tensor, group, group_name: str, region: str | None = None, async_op: bool = False):
    """Sum over ranks, then keep this rank's slice of dim 0 (dim 0 must divide by the group size).

    With ``async_op`` returns (out, work or None): the caller overlaps work (the wgrad GEMM) before ``wait``."""
    n = world_size(group)
    if n == 1:
        return (t, None) if async_op else t
    t = t.contiguous()
    t0 = _t0(t)
    out = torch.empty((t.shape[0] // n,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    work = None
    if t.is_cuda:
        work = dist.reduce_scatter_tensor(out, t, group=group, async_op=async_op)
    else:
        # gloo has no reduce_scatter: all-reduce then slice moves more bytes than NCCL would, but the
        # record counts the logical payload (the input), which is what the NCCL path sends.
        buf = t.clone()
        dist.all_reduce(buf, group=group)
        out.copy_(buf.chunk(n)[dist.get_rank(group)])
    _record("reduce_scatter", group_name, t, region, t0)
    return (out, work) if async_op else out


def reduce_scatter_into(buf: torch.Tensor, shard: torch.Tensor, group, group_name: str, region: str | None = None):
    """Sum the flat ``buf`` over ranks, keeping this rank's chunk in ``shard`` (``buf``'s own chunk: in place, as
    NCCL allows); starts asynchronously and returns the work handle (None on one rank). The rest of ``buf`` keeps
    this rank's own contribution."""
    if world_size(group) == 1:
        return None
    t0 = _t0(buf)
    work = dist.reduce_scatter_tensor(shard, buf, group=group, async_op=True)
    _record("reduce_scatter", group_name, buf, region, t0)
    return work


def all_gather_into(buf: torch.Tensor, shard: torch.Tensor, group, group_name: str, region: str | None = None):
    """Fill the flat ``buf`` with every rank's ``shard`` (this rank's may be ``buf``'s own chunk: in place); starts
    asynchronously and returns the work handle (None on one rank). Records this rank's payload, as ``all_gather``."""
    if world_size(group) == 1:
        return None
    t0 = _t0(buf)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in newer torch
    work = gather(buf, shard, group=group, async_op=True)
    _record("all_gather", group_name, shard, region, t0)
    return work


def all_reduce_flat(tensors: list[torch.Tensor], group, group_name: str, region: str | None = None) -> None:
    """One all-reduce over the concatenation of ``tensors`` (many small ones: one collective), copied back."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    all_reduce(flat, group, group_name, region=region)
    for t, v in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(v.view_as(t))


def defer(wait) -> None:
    """Remember the completion of an asynchronous transfer that a later reader must wait for (see ``settle``). A bound
    method is held weakly: a finished trainer's optimizer must not stay alive in this module-level list."""
    pending = getattr(_state, "pending", None)
    if pending is None:
        pending = _state.pending = []
    ref = weakref.WeakMethod(wait) if hasattr(wait, "__self__") else (lambda: wait)
    if all(r() != wait for r in pending):
        pending.append(ref)


def settle() -> None:
    """Complete every deferred transfer: before tensors are read outside the hooks that normally wait for them
    (consolidation, teardown)."""
    pending, _state.pending = getattr(_state, "pending", None) or [], []
    for ref in pending:
        wait = ref()
        if wait is not None:
            wait()


def agree(ok: bool, timeout_s: float = 60.0) -> bool | None:
    """Whether every rank passed ``ok``; None when some rank did not arrive within ``timeout_s``.

    Through the rendezvous store, not a collective: after one rank fails (an out-of-memory in one pipeline stage),
    the others may be blocked inside NCCL for good, and a collective would block the failed rank too. Every rank
    must call it the same number of times (each call is one round)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    n = dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    _state.rounds = getattr(_state, "rounds", 0) + 1
    key = f"megasparse/agree/{_state.rounds}"
    if not ok:
        store.add(f"{key}/failed", 1)
    store.add(f"{key}/arrived", 1)
    deadline = time.monotonic() + timeout_s
    while store.add(f"{key}/arrived", 0) < n:
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)
    return store.add(f"{key}/failed", 0) == 0


def broadcast(t: torch.Tensor, src: int, group, group_name: str, region: str | None = None) -> None:
    if world_size(group) == 1:
        return
    t0 = _t0(t)
    dist.broadcast(t, src=src, group=group)
    _record("broadcast", group_name, t, region, t0)


def isend(t: torch.Tensor, peer: int, group, group_name: str = "pp", region: str = "pipeline"):
    """A send that does not wait for its receiver: returns the work, which the caller keeps (with ``t``) until
    ``is_completed()`` or its own ``wait()``. Both directions of a link must not share one group: on NCCL a send
    still waiting holds its communicator's stream, and a receive queued behind it would wait too."""
    work = dist.isend(t, peer, group=group)
    _record("send", group_name, t, region, None)
    return work


def irecv(t: torch.Tensor, peer: int, group) -> None:
    """Receive into ``t`` and wait: the host under gloo; under NCCL the current stream, not the host."""
    dist.irecv(t, peer, group=group).wait()


def p2p(ops: list[tuple], group, group_name: str = "pp", region: str = "pipeline"):
    """Batched point-to-point: ``ops`` is a list of ("send"|"recv", tensor, global peer rank[, phase]).

    Returns after all transfers are done. Under gloo each op is issued separately (gloo has no
    batch_isend_irecv fusion), under NCCL they are batched so sends and receives cannot deadlock.
    An op's optional phase tags its record (one batch of the interleaved schedule carries activations
    and gradients); without one the current ``phase`` applies.
    """
    if not ops:
        return
    rec = _recorder()
    t0 = _t0(ops[0][1]) if rec is not None else None
    n0 = len(rec.records) if rec is not None else 0
    if ops[0][1].is_cuda:
        p2p_ops = [dist.P2POp(dist.isend if op[0] == "send" else dist.irecv, op[1], op[2], group) for op in ops]
        for w in dist.batch_isend_irecv(p2p_ops):
            w.wait()
    else:
        works = []
        for kind, t, peer, *_ in ops:
            fn = dist.isend if kind == "send" else dist.irecv
            works.append(fn(t, peer, group=group))
        for w in works:
            w.wait()
    for kind, t, _, *tag in ops:
        if kind == "send":
            with phase(tag[0]) if tag else contextlib.nullcontext():
                _record("send", group_name, t, region, None)
    if t0 is not None and rec is not None and len(rec.records) > n0:
        # the batch's time goes on its own last send (a receive-only batch has no record to carry it)
        torch.cuda.synchronize(ops[0][1].device)
        rec.records[-1].duration_ms = (time.perf_counter() - t0) * 1e3
