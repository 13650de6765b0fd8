"""Gradient buckets for data parallelism: contiguous fp32 buffers, reduced over DP while the backward still runs.

Layout. Parameters are laid out in reverse order of use (the output layer, the final norm, the last block, ...,
the embedding), grouped into buckets of about ``parallel.grad_bucket_numel`` elements. Each bucket's gradients
live in one flat fp32 buffer, so one collective per bucket moves them, and the earliest buckets of the backward
(the last layers) are reduced while the first layers' gradients are still being computed.

How gradients land there. Every parameter's ``main_grad`` is its slice of the buffer. An fp32 parameter's
``.grad`` *is* that slice (installed at every ``zero``, never set to None), so autograd's AccumulateGrad adds each
micro-batch's gradient into it in place: the compact backward (token filtering) returns ordinary full-shape weight
gradients and needs nothing special, and a captured CUDA graph accumulates into the same static buffer. A
parameter in another dtype (the bf16 compute copies of the distributed optimizer) gets a post-accumulate-grad hook
that adds ``.grad`` into ``main_grad`` and drops it. Gradients written outside autograd (the pipeline-sliced
embeddings) are taken over in ``finish``.

When a bucket starts. With ``overlap``, the post-accumulate-grad hook counts each parameter's gradients; when every
parameter of a bucket has had its last micro-batch's (one per micro-batch), the bucket's collective starts
asynchronously (NCCL runs it on its own stream; gloo on its own thread): a reduce-scatter when the optimizer is
sharded (each DP rank keeps the sum of its 1/dp chunk), an all-reduce otherwise. ``finish`` starts what is left
in bucket order, waits for all, then sums the sequence-parallel norms' gradients over TP (synchronously: they are
small). Every DP rank runs the same backward, so buckets start in the same order everywhere. The loss is already
normalised by the global token count, so the sum over DP is the mean gradient.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from megasparse.parallel import comm, state

__all__ = ["Bucket", "GradBuckets", "backward_order", "plan_buckets"]


def backward_order(model: nn.Module) -> list[nn.Parameter]:
    """The model's parameters in the order their gradients are expected: the module's own (the output layer) first,
    then the rest in reverse registration order (registration follows the forward)."""
    own = list(model.parameters(recurse=False))
    seen = {id(p) for p in own}
    return own + [p for p in reversed(list(model.parameters())) if id(p) not in seen]


def plan_buckets(numels: list[int], cap: int, align: int = 1, multiple: int = 1) -> list[tuple[list[int], int]]:
    """Group consecutive parameters into buckets of about ``cap`` elements (a larger parameter gets one alone).

    Returns, per bucket, each parameter's start offset (a multiple of ``align``) and the bucket's padded size (a
    multiple of ``multiple``, so it splits into equal DP shards)."""
    out: list[tuple[list[int], int]] = []
    starts: list[int] = []
    size = 0
    for n in numels:
        if starts and size + n > cap:
            out.append((starts, -(-size // multiple) * multiple))
            starts, size = [], 0
        starts.append(size)
        size = -(-(size + n) // align) * align
    if starts:
        out.append((starts, -(-size // multiple) * multiple))
    return out


@dataclass
class Bucket:
    """One flat fp32 gradient buffer and the parameters it serves."""

    index: int
    params: list[nn.Parameter]
    ranges: list[tuple[int, int]]
    """Each parameter's [start, end) in the buffer."""
    grad: torch.Tensor
    data: torch.Tensor | None = None
    """The parameters' own storage, when the distributed optimizer gathers them into it (else None)."""
    work: object = None
    waiting: int = 0
    """Parameters whose last micro-batch's gradient has not arrived yet."""
    started: bool = False
    by_hook: bool = field(default=False)
    """The collective was started from the backward (overlapped), not by ``finish``."""

    @property
    def numel(self) -> int:
        return self.grad.numel()

    def shard(self, rank: int, n: int) -> tuple[int, int]:
        """[lo, hi) of DP rank ``rank``'s chunk of the buffer."""
        size = self.numel // n
        return rank * size, (rank + 1) * size

    def segments(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(parameter index in the bucket, start, end) of each parameter's part inside [lo, hi)."""
        out = []
        for i, (a, b) in enumerate(self.ranges):
            s, e = max(a, lo), min(b, hi)
            if s < e:
                out.append((i, s, e))
        return out


class GradBuckets:
    """The DP gradient buffers of one pipeline stage, their hooks and their collectives."""

    def __init__(
        self,
        params: list[nn.Parameter],
        *,
        cap: int,
        shard: bool,
        overlap: bool,
        align: int = 1,
        sequence_parallel: bool = False,
    ) -> None:
        lay = state.layout()
        self.group, self.dp, self.rank = state.dp_group(), lay.dp, lay.dp_rank
        self.shard_grads, self.overlap, self.sp = shard, overlap, sequence_parallel and lay.tp > 1
        self.params = list(params)
        multiple = align * self.dp if shard else 1
        plan = plan_buckets([p.numel() for p in self.params], cap, align, multiple)
        self.buckets: list[Bucket] = []
        self.bucket_of: list[Bucket] = []
        i = 0
        for b, (starts, size) in enumerate(plan):
            ps = self.params[i : i + len(starts)]
            i += len(starts)
            grad = torch.zeros(size, dtype=torch.float32, device=ps[0].device)
            bucket = Bucket(b, ps, [(s, s + p.numel()) for s, p in zip(starts, ps)], grad)
            for p, (s, e) in zip(ps, bucket.ranges):
                p.main_grad = grad[s:e].view(p.shape)
                self.bucket_of.append(bucket)
            self.buckets.append(bucket)
        self.counts = [0] * len(self.params)
        self.expected = 1
        self._sp_views: list[torch.Tensor] | None = None
        me = weakref.ref(self)  # autograd's C++ nodes hold the hooks: a strong ref would keep the buckets (and
        for idx, p in enumerate(self.params):  # through them the model) alive after the trainer is gone
            p.register_post_accumulate_grad_hook(GradBuckets._hook(me, idx))
        self.zero(1)

    # -- per step ---------------------------------------------------------------------------------------------------
    def zero(self, micro_batches: int) -> None:
        """Clear the buffers for a step of ``micro_batches`` backward passes; reinstall the fp32 ``.grad`` views."""
        self.expected = micro_batches
        self.counts = [0] * len(self.params)
        for b in self.buckets:
            b.grad.zero_()
            b.work, b.started, b.by_hook, b.waiting = None, False, False, len(b.params)
        for p in self.params:
            if p.dtype == torch.float32:
                if p.grad is None or p.grad.data_ptr() != p.main_grad.data_ptr():
                    p.grad = p.main_grad
            else:
                p.grad = None

    @staticmethod
    def _hook(me: weakref.ref, idx: int) -> Callable[[nn.Parameter], None]:
        def hook(p: nn.Parameter) -> None:
            self = me()
            if self is None:
                return
            g = p.grad
            if g is not None and g.data_ptr() != p.main_grad.data_ptr():
                p.main_grad.add_(g)  # a compute-dtype gradient (or a fresh one after set_to_none): into the buffer
                p.grad = p.main_grad if p.dtype == torch.float32 else None
            if not self.overlap:
                return
            b = self.bucket_of[idx]
            if b.started:
                raise RuntimeError(
                    f"a gradient of a {tuple(p.shape)} parameter arrived after its bucket's DP reduction started "
                    f"({self.counts[idx] + 1} backward passes in a step of {self.expected} micro-batches)"
                )
            self.counts[idx] += 1
            if self.counts[idx] == self.expected:
                b.waiting -= 1
                if b.waiting == 0:
                    self._start(b, by_hook=True)

        return hook

    def _start(self, b: Bucket, by_hook: bool = False) -> None:
        with comm.phase("optim"):
            if self.shard_grads:
                lo, hi = b.shard(self.rank, self.dp)
                b.work = comm.reduce_scatter_into(b.grad, b.grad[lo:hi], self.group, "dp", region="grads.dp")
            else:
                b.work = comm.all_reduce(b.grad, self.group, "dp", region="grads.dp", async_op=True)
        b.started, b.by_hook = True, by_hook

    def finish(self) -> None:
        """After the backward: take over gradients written outside autograd, start the buckets not yet started,
        wait for all, and sum the SP-replicated gradients over TP. The optimizer may then read them."""
        for p in self.params:
            g = p.grad
            if g is None or g.data_ptr() == p.main_grad.data_ptr():
                continue
            if p.dtype == torch.float32:  # ``.grad`` was replaced (the pipeline-sliced embedding): it is the sum
                p.main_grad.copy_(g)
                p.grad = p.main_grad
            else:
                p.main_grad.add_(g)
                p.grad = None
        for b in self.buckets:
            if not b.started:
                self._start(b)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
        if self.sp:
            self._sum_sp_over_tp()

    def _sum_sp_over_tp(self) -> None:
        """Norm weights see a different sequence shard on each TP rank: sum their (owned) gradients over TP."""
        if self._sp_views is None:  # the buffers are zeroed in place, never replaced: their views are found once
            self._sp_views = []
            for b in self.buckets:
                lo, hi = b.shard(self.rank, self.dp) if self.shard_grads else (0, b.numel)
                sp = [b.grad[s:e] for i, s, e in b.segments(lo, hi) if getattr(b.params[i], "sequence_parallel", 0)]
                self._sp_views += sp
        if self._sp_views:
            with comm.phase("optim"):
                comm.all_reduce_flat(self._sp_views, state.tp_group(), "tp", region="grads.sp_norms")

    @property
    def overlapped(self) -> int:
        """Buckets whose collective this step started from inside the backward."""
        return sum(b.by_hook for b in self.buckets)
