"""Pipeline parallelism: P2P between stages and a 1F1B schedule that runs under gloo and NCCL.

Forward sends are dense activations of a static shape. Backward sends are either dense gradients or,
with token filtering, compact ones: the kept rows plus their indices. The indices are the global
(TP-region) kept rows of the micro-batch, whose count ``k`` every stage knows ahead from the
config; under sequence parallelism each TP rank then derives its own shard's row count from them,
so a receiver needs no shape exchange. Per-micro-batch filter state therefore travels with the
gradient and each stage keeps nothing but its saved activations, in schedule order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megasparse.ops.compact import CompactGrad, KeepMeta
from megasparse.parallel import comm, rows, state


class _Catch(torch.autograd.Function):
    """Identity whose backward stores the incoming gradient (dense or compact) for the P2P send."""

    @staticmethod
    def forward(ctx, x, holder: dict):
        ctx.holder = holder
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.holder["grad"] = g
        return None, None


@dataclass
class P2PSpec:
    act_shape: tuple[int, ...]
    """Activation shape sent between stages ([s(/tp), b, h])."""
    dtype: torch.dtype
    device: torch.device
    kept_rows: Callable[[], int] | None = None
    """Global kept-row count per micro-batch when the backward is compact (None: dense)."""
    batch: int = 1
    """b of the activation layout (for the kept-row metadata)."""
    seq_count: int | None = None
    """Kept rows per sequence when the selection fixes it (``KeepMeta.seq_count``)."""
    shards: int = 1
    """SP shards the selection balances the kept rows over (``KeepMeta.shards``): with it, a receiver knows its
    row count before the indices arrive and posts both receives at once."""


class StageComm:
    """Sends and receives for one pipeline stage."""

    def __init__(self, spec: P2PSpec):
        self.spec = spec
        lay = state.layout()
        self.lay = lay
        self.group = state.pp_group()
        self.next = state.pp_next_rank() if not lay.is_last_stage else None
        self.prev = state.pp_prev_rank() if not lay.is_first_stage else None

    def _act(self) -> torch.Tensor:
        return torch.empty(self.spec.act_shape, dtype=self.spec.dtype, device=self.spec.device)

    def _grad_ops(self, g: torch.Tensor) -> list:
        if isinstance(g, CompactGrad):
            gmeta = g.meta.global_meta() if self.lay.sequence_parallel else g.meta
            return [("send", gmeta.idx, self.prev), ("send", g.rows.contiguous(), self.prev)]
        return [("send", g.contiguous(), self.prev)]

    def _sp(self) -> int:
        return self.lay.tp if self.lay.sequence_parallel else 1

    def _static_rows(self) -> int | None:
        """This rank's compact row count when the selection fixes it (then no wait on the indices)."""
        k, tp = self.spec.kept_rows(), self._sp()
        if tp == 1 or self.spec.shards == tp:
            return k // tp
        return None

    def _recv_grad_phase1(self) -> tuple[list, tuple]:
        if self.spec.kept_rows is None:
            buf = self._act()
            return [("recv", buf, self.next)], (buf, None)
        idx = torch.empty(self.spec.kept_rows(), dtype=torch.long, device=self.spec.device)
        ops = [("recv", idx, self.next)]
        n = self._static_rows()
        rows_buf = None
        if n is not None:  # row count known from the config: post the rows with the indices
            rows_buf = torch.empty(n, self.spec.act_shape[-1], dtype=self.spec.dtype, device=self.spec.device)
            ops.append(("recv", rows_buf, self.next))
        return ops, (idx, rows_buf)

    def _recv_grad_phase2(self, bufs: tuple) -> torch.Tensor:
        buf, r = bufs
        if self.spec.kept_rows is None:
            return buf
        s_local, b, h = self.spec.act_shape
        tp = self._sp()
        gmeta = KeepMeta(buf, s_local * b * tp, b, seq_count=self.spec.seq_count, shards=self.spec.shards)
        meta = gmeta
        if tp > 1:
            meta, _ = rows.sp_split(gmeta, tp, self.lay.tp_rank)
        if r is None:  # unbalanced shards: this rank's count comes from the indices
            r = torch.empty(meta.idx.numel(), h, dtype=self.spec.dtype, device=self.spec.device)
            comm.p2p([("recv", r, self.next)], self.group)
        return CompactGrad(r, meta, self.spec.act_shape)

    # -- the four transfers (and the two fused ones of the steady state) ------------------------
    def recv_forward(self) -> torch.Tensor | None:
        if self.prev is None:
            return None
        t = self._act()
        comm.p2p([("recv", t, self.prev)], self.group)
        return t

    def send_forward(self, y: torch.Tensor) -> None:
        if self.next is not None:
            comm.p2p([("send", y.contiguous(), self.next)], self.group)

    def recv_backward(self) -> torch.Tensor | None:
        if self.next is None:
            return None
        ops, buf = self._recv_grad_phase1()
        comm.p2p(ops, self.group)
        return self._recv_grad_phase2(buf)

    def send_backward(self, g: torch.Tensor | None) -> None:
        if self.prev is not None:
            comm.p2p(self._grad_ops(g), self.group)

    def send_forward_recv_backward(self, y: torch.Tensor) -> torch.Tensor | None:
        if self.next is None:
            return None
        ops, buf = self._recv_grad_phase1()
        comm.p2p([("send", y.contiguous(), self.next)] + ops, self.group)
        return self._recv_grad_phase2(buf)

    def exchange(
        self, y: torch.Tensor | None, want_x: bool, g: torch.Tensor | None, want_g: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One lock-step boundary: send last period's output ``y`` / input gradient ``g``, receive this period's.

        Forward transfers first, then backward ones, each one batch posted by every stage at the same boundary;
        compact gradients go as indices then rows, like 1F1B's."""
        x = self._swap(y, self.next, want_x, self.prev)
        with comm.phase("backward"):
            ops = self._grad_ops(g) if g is not None and self.prev is not None else []
            buf = None
            if want_g and self.next is not None:
                recv, buf = self._recv_grad_phase1()
                ops += recv
            comm.p2p(ops, self.group)
            gin = self._recv_grad_phase2(buf) if buf is not None else None
        return x, gin

    def _swap(self, t: torch.Tensor | None, to: int | None, want: bool, frm: int | None) -> torch.Tensor | None:
        """Send ``t`` to ``to`` and receive an activation-shaped tensor from ``frm`` in one batch."""
        ops = [("send", t.contiguous(), to)] if t is not None and to is not None else []
        r = self._act() if want and frm is not None else None
        if r is not None:
            ops.append(("recv", r, frm))
        comm.p2p(ops, self.group)
        return r

    def send_backward_recv_forward(self, g: torch.Tensor | None) -> torch.Tensor | None:
        if self.prev is None:
            return None
        t = self._act()
        comm.p2p(self._grad_ops(g) + [("recv", t, self.prev)], self.group)
        return t


def catch_grad(x: torch.Tensor, holder: dict) -> torch.Tensor:
    """Identity whose backward leaves the incoming gradient (dense or compact) in ``holder["grad"]``."""
    return _Catch.apply(x, holder)


def one_f_one_b(
    num_mb: int,
    p2p: StageComm,
    forward_step: Callable[[int, torch.Tensor | None], torch.Tensor],
    backward_step: Callable[[int, torch.Tensor, torch.Tensor | None], None],
) -> None:
    """Non-interleaved 1F1B: warm-up forwards, steady one-forward-one-backward, cool-down backwards.

    ``forward_step(i, input)`` returns the stage output (the scalar loss on the last stage);
    ``backward_step(i, output, grad)`` runs autograd from it. The input gradient that goes upstream
    is caught at the stage entry, so compact gradients never reach a leaf.
    """
    lay = state.layout()
    warmup = min(lay.pp - lay.pp_rank - 1, num_mb)
    holders: list[dict] = [{} for _ in range(num_mb)]
    outputs: dict[int, torch.Tensor] = {}

    def fwd(i: int, x: torch.Tensor | None) -> torch.Tensor:
        if x is not None:
            x = _Catch.apply(x.requires_grad_(), holders[i])
        out = forward_step(i, x)
        outputs[i] = out
        return out

    def bwd(i: int, g: torch.Tensor | None):
        with comm.phase("backward"):
            backward_step(i, outputs.pop(i), g)
        return holders[i].pop("grad", None)

    fi = bi = 0
    for _ in range(warmup):
        y = fwd(fi, p2p.recv_forward())
        p2p.send_forward(y)
        fi += 1
    x = p2p.recv_forward() if num_mb > warmup else None
    for step in range(num_mb - warmup):
        y = fwd(fi, x)
        fi += 1
        g = p2p.send_forward_recv_backward(y) if not lay.is_last_stage else None
        gin = bwd(bi, g)
        bi += 1
        if step == num_mb - warmup - 1:
            x = None
            with comm.phase("backward"):
                p2p.send_backward(gin)
        else:
            with comm.phase("backward"):
                x = p2p.send_backward_recv_forward(gin)
    for _ in range(warmup):
        with comm.phase("backward"):
            g = p2p.recv_backward()
        gin = bwd(bi, g)
        bi += 1
        with comm.phase("backward"):
            p2p.send_backward(gin)


def lockstep(
    num_mb: int,
    p2p: StageComm,
    forward_step: Callable[[int, torch.Tensor | None], torch.Tensor],
    backward_step: Callable[[int, torch.Tensor, torch.Tensor | None], None],
    slot: Callable[[int], None] | None = None,
) -> None:
    """Every stage forwards, joins micro-batch k's vocabulary slot, then backwards, in the same period.

    For ``loss.vocab_over_pp``: the output layer's slices meet in collectives once per micro-batch, so the
    stages must reach them together. In period p stage r runs F(p − r), the slot of micro-batch p − (P−1)
    (the last stage's is inside its own F/B: its loss), then B(p − 2(P−1) + r); every input was produced one
    period earlier by a neighbour and crosses at the period boundary (``StageComm.exchange``). With equal stage
    times the slot costs no waiting (1F1B would put it where the other stages are out of phase by a backward).
    The price: stage r holds 2(P−1−r)+1 micro-batches in flight instead of P−r (docs/decisions/0800).
    """
    lay = state.layout()
    P, r = lay.pp, lay.pp_rank
    holders: list[dict] = [{} for _ in range(num_mb)]
    outputs: dict[int, torch.Tensor] = {}
    y = gin = None
    for p in range(num_mb + 2 * (P - 1)):
        fi, si, bi = p - r, p - (P - 1), p - 2 * (P - 1) + r
        do_f, do_b = 0 <= fi < num_mb, 0 <= bi < num_mb
        x, g = p2p.exchange(y, do_f, gin, do_b)
        y = gin = None
        if do_f:
            if x is not None:
                x = _Catch.apply(x.requires_grad_(), holders[fi])
            out = forward_step(fi, x)
            outputs[fi] = out
            y = None if lay.is_last_stage else out
        if slot is not None and 0 <= si < num_mb:
            slot(si)
        if do_b:
            with comm.phase("backward"):
                backward_step(bi, outputs.pop(bi), g)
            gin = holders[bi].pop("grad", None)
    # every stage's last input gradient crossed inside the loop, except the first stage's, which has no consumer
