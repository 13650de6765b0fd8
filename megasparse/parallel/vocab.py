"""Collectives of the vocabulary-parallel loss (all through ``comm``).

The output weight is sharded over TP ranks by vocabulary rows. Each rank computes, per token, the
log-sum-exp of its shard and the target logit if the target is in its shard; ``merge_shard_stats``
combines them with ONE all-gather of a [2, n] fp32 tensor and a local reduction in rank order, so
every TP rank ends with bit-identical losses (token selection relies on that). See
docs/decisions/0200-cce-lse-merge.md.

Hidden states enter either whole (plain TP: identity forward, all-reduce of dE backward) or as this
rank's sequence shard (SP: all-gather forward, reduce-scatter of dE backward). With token filtering
the backward collective carries only the kept rows (``reduce_kept_grad``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megasparse.parallel import comm

GROUP = "tp"
REGION = "loss.dgrad"
"""Region of the hidden-state gradient's collective (what the profiler groups by); the forward ones below."""
REGION_GATHER = "loss.sp_gather"
REGION_STATS = "loss.stats"


def tp_size(group) -> int:
    return comm.world_size(group)


def tp_rank(group) -> int:
    import torch.distributed as dist

    return dist.get_rank(group) if tp_size(group) > 1 else 0


def vocab_range(vocab_size: int, group) -> tuple[int, int, int]:
    """(vocab_start, rows per shard, padded vocab) of this rank: shards are equal, the tail is padding."""
    n = tp_size(group)
    per = -(-vocab_size // n)
    return tp_rank(group) * per, per, per * n


def gather_rows(h: Tensor, group, sequence_parallel: bool) -> Tensor:
    """Rows of the whole TP region: all-gather of the sequence shards under SP, else ``h`` itself."""
    if not sequence_parallel:
        return h
    return comm.all_gather(h, group, GROUP, dim=0, region=REGION_GATHER)


def merge_shard_stats(
    lse: Tensor, tgt: Tensor, group, kind: str = GROUP, region: str = REGION_STATS
) -> tuple[Tensor, Tensor]:
    """Global (lse, target logit) per token from every shard's pieces; O(shards·n) bytes, one collective.

    ``group``/``kind``: the TP group for the TP loss, the model-parallel group (``mp``) for the pipeline slices."""
    n = comm.world_size(group)
    if n == 1:
        return lse, tgt
    parts = comm.all_gather(torch.stack([lse.float(), tgt.float()]), group, kind, dim=0, region=region)
    parts = parts.view(n, 2, -1)
    return torch.logsumexp(parts[:, 0], dim=0), parts[:, 1].sum(0)


def reduce_kept_grad(d_rows: Tensor, rows: Tensor | None, n_total: int, group, sequence_parallel: bool) -> Tensor:
    """Sum per-shard dE over TP and return this rank's hidden gradient (dense, zero on rows not in ``rows``).

    ``rows`` (ascending row indices into the TP region, identical on every rank) names the rows of
    ``d_rows``; None means all rows. Only these rows travel. Under SP each rank's kept rows are
    reduce-scattered, padded to the largest per-shard count (zero padding when selection is balanced).
    """
    n = tp_size(group)
    if rows is None:
        if sequence_parallel:
            return comm.reduce_scatter(d_rows, group, GROUP, region=REGION)
        comm.all_reduce(d_rows, group, GROUP, region=REGION)
        return d_rows
    d = d_rows.shape[1]
    if not sequence_parallel:
        comm.all_reduce(d_rows, group, GROUP, region=REGION)
        out = d_rows.new_zeros(n_total, d)
        out.index_copy_(0, rows, d_rows)
        return out
    n_local = n_total // n
    owner = rows // n_local
    counts = torch.bincount(owner, minlength=n)
    kmax = int(counts.max()) if rows.numel() else 0
    out = d_rows.new_zeros(n_local, d)
    if kmax == 0:
        return out
    starts = torch.cumsum(counts, 0) - counts
    slot = owner * kmax + (torch.arange(rows.numel(), device=rows.device) - starts[owner])
    buf = d_rows.new_zeros(n * kmax, d)
    buf.index_copy_(0, slot, d_rows)
    mine = comm.reduce_scatter(buf, group, GROUP, region=REGION)
    me = tp_rank(group)
    sel = owner == me
    out.index_copy_(0, rows[sel] - me * n_local, mine[: int(counts[me])])
    return out


def compact_kept_grad(d_rows: Tensor, meta, group, sequence_parallel: bool, h_shape) -> Tensor:
    """dE of the kept rows (``meta.idx`` order, one row each) as a compact gradient: only kept rows travel."""
    from megasparse.ops.compact import CompactGrad
    from megasparse.parallel import rows as rowops

    with comm.phase("backward"):
        if sequence_parallel and tp_size(group) > 1:
            n, me = tp_size(group), tp_rank(group)
            local_rows, local, work = rowops.reduce_scatter_rows(d_rows, meta, group, n, me, REGION)
            if work is not None:
                work.wait()
            return CompactGrad(local_rows.to(d_rows.dtype), local, h_shape)
        comm.all_reduce(d_rows, group, GROUP, region=REGION)
    return CompactGrad(d_rows, meta, h_shape)


class GatherRows(torch.autograd.Function):
    """Megatron's copy-to / gather-from-SP region: identity or all-gather forward, all-reduce or reduce-scatter back."""

    @staticmethod
    def forward(ctx, h: Tensor, group, sequence_parallel: bool) -> Tensor:
        ctx.group, ctx.sp, ctx.n = group, sequence_parallel, h.shape[0]
        out = gather_rows(h, group, sequence_parallel)
        return out if sequence_parallel else h.view_as(h)

    @staticmethod
    def backward(ctx, g: Tensor):
        with comm.phase("backward"):
            return reduce_kept_grad(g.contiguous().clone(), None, g.shape[0], ctx.group, ctx.sp), None, None
