"""Token-compacting collectives: move only kept rows across TP/SP ranks.

Rows are tokens of the [s, b, h] activation flattened s-major (row = pos·b + seq). Under sequence
parallelism rank r owns global rows [r·L, (r+1)·L) with L = s·b/tp. All TP ranks hold the same
global kept indices (they compute identical losses), so each can split them into per-shard counts
without communication. Shards with fewer kept rows than the largest are padded to it: the
collectives need equal sizes, and the padding is what the profiler counts.
"""

from __future__ import annotations

import torch

from megasparse.ops.compact import KeepMeta
from megasparse.parallel import comm


def sp_split(global_meta: KeepMeta, tp: int, tp_rank: int) -> tuple[KeepMeta, list[int]]:
    """This rank's local meta and every shard's kept count (memoised on the global meta)."""

    def build():
        L = global_meta.num_rows // tp
        counts = global_meta.shard_counts(tp)
        static = counts is not None
        if not static:  # data-dependent split: the one host sync of an unbalanced selection
            counts = torch.bincount(global_meta.idx // L, minlength=tp).tolist()
        start = sum(counts[:tp_rank])
        local_idx = global_meta.idx[start : start + counts[tp_rank]] - tp_rank * L
        seq = global_meta.seq_count
        local_seq = seq // tp if static and seq is not None and global_meta.shards == tp else None
        local = KeepMeta(local_idx, L, global_meta.batch, seq_count=local_seq)
        local._cache["sp_global"] = global_meta
        return local, counts

    return global_meta.derived(("sp_local", tp, tp_rank), build)


def sp_join(local_meta: KeepMeta, tp: int, group) -> KeepMeta:
    """The global meta of a local one (memoised; the indices travel only if not already known)."""

    def build():
        n = torch.tensor([local_meta.idx.numel()], device=local_meta.idx.device)
        counts = comm.all_gather(n, group, "tp", region="filter.meta").tolist()
        pad = max(counts)
        buf = local_meta.idx.new_full((pad,), -1)
        buf[: local_meta.idx.numel()] = local_meta.idx
        allidx = comm.all_gather(buf, group, "tp", region="filter.meta").view(tp, pad)
        L = local_meta.num_rows
        parts = [allidx[r, : counts[r]] + r * L for r in range(tp)]
        return KeepMeta(torch.cat(parts), L * tp, local_meta.batch)

    return local_meta.derived("sp_global", build)


def gather_rows(rows: torch.Tensor, local_meta: KeepMeta, group, tp: int, tp_rank: int, region: str):
    """SP backward all-gather on kept rows: local [c_r, h] → global [Σc, h] (padded to max c)."""
    gmeta = sp_join(local_meta, tp, group)
    _, counts = sp_split(gmeta, tp, tp_rank)
    pad = max(counts)
    if rows.shape[0] < pad:
        rows = torch.cat([rows, rows.new_zeros(pad - rows.shape[0], rows.shape[1])])
    out = comm.all_gather(rows, group, "tp", region=region)
    if pad * tp != gmeta.idx.numel():
        out = torch.cat([out[r * pad : r * pad + counts[r]] for r in range(tp)])
    return out, gmeta


def reduce_scatter_rows(rows: torch.Tensor, global_meta: KeepMeta, group, tp: int, tp_rank: int, region: str):
    """SP backward reduce-scatter on kept rows: global [Σc, h] partial sums → this rank's [c_r, h].

    Asynchronous: returns (rows, local meta, work or None); wait on work before reading the rows."""
    local, counts = sp_split(global_meta, tp, tp_rank)
    pad = max(counts)
    if pad * tp != rows.shape[0]:
        padded = rows.new_zeros(pad * tp, rows.shape[1])
        start = 0
        for r, c in enumerate(counts):
            padded[r * pad : r * pad + c] = rows[start : start + c]
            start += c
        rows = padded
    out, work = comm.reduce_scatter(rows, group, "tp", region=region, async_op=True)
    return out[: counts[tp_rank]], local, work
