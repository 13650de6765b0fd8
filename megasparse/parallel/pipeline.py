"""Pipeline parallelism: P2P between stages and a 1F1B schedule that runs under gloo and NCCL.

Forward sends are dense activations of a static shape. Backward sends are either dense gradients or,
with token filtering, compact ones: the kept rows plus their indices. The indices are the global
(TP-region) kept rows of the micro-batch, whose count ``k`` every stage knows ahead from the
config; under sequence parallelism each TP rank then derives its own shard's row count from them,
so a receiver needs no shape exchange. Per-micro-batch filter state therefore travels with the
gradient and each stage keeps nothing but its saved activations, in schedule order.

With ``parallel.virtual_stages`` > 1 the ranks form a ring and ``one_f_one_b`` runs Megatron's interleaved
schedule (``parallel/interleaved.py`` plans it, ``interleaved_1f1b`` executes it) over the same transfers: a
chunk's compact gradient crosses to the previous virtual stage as indices then rows, exactly as between stages.

Why this file is long: one home for every transfer between pipeline stages (the rendezvous batches, ChunkFlow's
``FreeSends``) and the fixed-length schedules that run over them; splitting them would spread one protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megasparse.ops.compact import CompactGrad, KeepMeta
from megasparse.parallel import comm, interleaved, rows, state


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
    """Sends and receives for one pipeline stage (all its ``chunks``: virtual stages, then the ranks are a ring)."""

    def __init__(self, spec: P2PSpec, chunks: int = 1):
        self.spec = spec
        lay = state.layout()
        self.lay = lay
        self.chunks = chunks
        self.group = state.pp_group()
        self.grad_group = state.pp_grad_group()  # FreeSends' gradients (None below pp 2)
        ring = chunks > 1  # rank P−1's chunk c feeds rank 0's chunk c+1
        self.next = state.pp_next_rank() if ring or not lay.is_last_stage else None
        self.prev = state.pp_prev_rank() if ring or not lay.is_first_stage else None

    def _act(self) -> torch.Tensor:
        return torch.empty(self.spec.act_shape, dtype=self.spec.dtype, device=self.spec.device)

    def _grad_ops(self, g: torch.Tensor) -> list:
        if isinstance(g, CompactGrad):
            gmeta = g.meta.global_meta() if self.lay.sequence_parallel else g.meta
            return [("send", gmeta.idx, self.prev), ("send", g.rows.contiguous(), self.prev)]
        return [("send", g.contiguous(), self.prev)]

    def _sp(self) -> int:
        return self.lay.tp if self.lay.sequence_parallel else 1

    def static_rows(self) -> int | None:
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
        n = self.static_rows()
        rows_buf = None
        if n is not None:  # row count known from the config: post the rows with the indices
            rows_buf = torch.empty(n, self.spec.act_shape[-1], dtype=self.spec.dtype, device=self.spec.device)
            ops.append(("recv", rows_buf, self.next))
        return ops, (idx, rows_buf)

    def local_meta(self, idx: torch.Tensor) -> KeepMeta:
        """This rank's kept-row meta from the global (TP-region) indices a compact gradient arrives with."""
        s_local, b, _ = self.spec.act_shape
        tp = self._sp()
        gmeta = KeepMeta(idx, s_local * b * tp, b, seq_count=self.spec.seq_count, shards=self.spec.shards)
        return rows.sp_split(gmeta, tp, self.lay.tp_rank)[0] if tp > 1 else gmeta

    def compact_grad(self, idx: torch.Tensor, rows_: torch.Tensor) -> CompactGrad:
        """The stage output's compact gradient from its global indices and this rank's rows (a captured backward
        builds it from static buffers the same way)."""
        return CompactGrad(rows_, self.local_meta(idx), self.spec.act_shape)

    def _recv_grad_phase2(self, bufs: tuple, sends: list | None = None) -> torch.Tensor:
        """The received gradient; ``sends`` (rows held back by ``send_recv``) go in the rows' batch."""
        buf, r = bufs
        sends = sends or []
        if self.spec.kept_rows is None:
            comm.p2p(sends, self.group)
            return buf
        meta = self.local_meta(buf)
        if r is None:  # unbalanced shards: this rank's count comes from the indices
            r = torch.empty(meta.idx.numel(), self.spec.act_shape[-1], dtype=self.spec.dtype, device=self.spec.device)
            sends = sends + [("recv", r, self.next)]
        comm.p2p(sends, self.group)
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

    def send_recv(
        self, y: torch.Tensor | None, want_x: bool, g: torch.Tensor | None, want_g: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One batch of the interleaved schedule (an ``interleaved.Comm``): send ``y`` on and ``g`` back, receive
        an input and an output gradient, all posted at once.

        Forward ops first, then backward ones, on every rank: with pp = 2 both peers are one rank, activations and
        gradients share one channel, and both ends must post them in one order (the plan pairs the batches;
        ``interleaved.simulate`` checks it). Compact gradients whose row count only the indices tell send their
        rows in a second batch with the receive of the rows: held in the first batch, round the ring every rank
        would wait for a receive its peer posts only after that batch."""
        x, gin, _ = self.send_recv_kept(y, want_x, g, want_g)
        return x, gin

    def send_recv_kept(
        self,
        y: torch.Tensor | None,
        want_x: bool,
        g: torch.Tensor | None,
        want_g: bool,
        kept: torch.Tensor | None = None,
        want_kept: int | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``send_recv`` whose gradients may carry indices too: ``kept`` goes back with ``g`` and ``want_kept``
        indices come with the received gradient, each right after its gradient's indices in the first batch (both
        ends in one order). ChunkFlow's collider passes a sequence's kept positions down this way (decision
        1223)."""
        ops: list = [("send", y.contiguous(), self.next, "forward")] if y is not None else []
        x = self._act() if want_x else None
        if x is not None:
            ops.append(("recv", x, self.prev))
        later: list = []
        if g is not None:
            sends = [(*op, "backward") for op in self._grad_ops(g)]
            split = isinstance(g, CompactGrad) and self.static_rows() is None
            ops, later = (ops + sends[:1], sends[1:]) if split else (ops + sends, [])
        if kept is not None:
            ops.append(("send", kept.contiguous(), self.prev, "backward"))
        bufs = None
        if want_g:
            recv, bufs = self._recv_grad_phase1()
            ops += recv
        idx = None if want_kept is None else torch.empty(want_kept, dtype=torch.long, device=self.spec.device)
        if idx is not None:
            ops.append(("recv", idx, self.next))
        comm.p2p(ops, self.group)
        if bufs is None:
            comm.p2p(later, self.group)
            return x, None, idx
        with comm.phase("backward"):
            return x, self._recv_grad_phase2(bufs, later), idx

    def send_backward_recv_forward(self, g: torch.Tensor | None) -> torch.Tensor | None:
        if self.prev is None:
            return None
        t = self._act()
        comm.p2p(self._grad_ops(g) + [("recv", t, self.prev)], self.group)
        return t


class FreeSends:
    """One stage's transfers where a send never waits for its receiver (ChunkFlow's tables built with the ops' real
    proportions, decision 1249): activations go on the pipeline group, gradients on ``state.pp_grad_group``, so the
    two directions of a link never queue behind each other on one NCCL communicator's stream. A receive waits for its
    data (the host under gloo, the compute stream under NCCL). Each send's buffer is kept until it completed; dense
    gradients only (collider's compact ones pair their indices and rows in rendezvous batches)."""

    def __init__(self, stage: StageComm):
        assert stage.grad_group is not None, "FreeSends needs the pipeline's gradient group (pp >= 2)"
        self.stage = stage
        self.pending: list[tuple] = []  # (work, tensor) of the sends not yet known complete

    def send_forward(self, y: torch.Tensor) -> None:
        y = y.contiguous()
        self.pending.append((comm.isend(y, self.stage.next, self.stage.group), y))
        self._prune()

    def send_backward(self, g: torch.Tensor) -> None:
        assert not isinstance(g, CompactGrad), "FreeSends carries dense gradients only"
        g = g.contiguous()
        with comm.phase("backward"):
            self.pending.append((comm.isend(g, self.stage.prev, self.stage.grad_group), g))
        self._prune()

    def recv_forward(self) -> torch.Tensor:
        x = self.stage._act()
        comm.irecv(x, self.stage.prev, self.stage.group)
        return x

    def recv_backward(self) -> torch.Tensor:
        g = self.stage._act()
        comm.irecv(g, self.stage.next, self.stage.grad_group)
        return g

    def settle(self) -> None:
        """Wait for every send (the end of a step: no buffer may go back to the allocator while a peer reads it)."""
        for work, _ in self.pending:
            work.wait()
        self.pending = []

    def _prune(self) -> None:
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]


def catch_grad(x: torch.Tensor, holder: dict) -> torch.Tensor:
    """Identity whose backward leaves the incoming gradient (dense or compact) in ``holder["grad"]``."""
    return _Catch.apply(x, holder)


class InFlight:
    """This stage's micro-batches between their forward and their backward, under any schedule: each one's output,
    and the input gradient its backward leaves at the stage entry (caught there, so a compact gradient never reaches
    a leaf). ``key`` names a micro-batch (or a (chunk, micro-batch) pair) until its backward."""

    def __init__(self, forward_step: Callable, backward_step: Callable):
        self.forward_step, self.backward_step = forward_step, backward_step
        self.outputs: dict = {}
        self.caught: dict = {}

    def forward(self, key, mb: int, x: torch.Tensor | None, *chunk: int) -> torch.Tensor:
        if x is not None:
            x = _Catch.apply(x.requires_grad_(), self.caught.setdefault(key, {}))
        out = self.outputs[key] = self.forward_step(mb, x, *chunk)
        return out

    def backward(self, key, mb: int, g: torch.Tensor | None) -> torch.Tensor | None:
        """Run micro-batch ``key``'s backward from its output; the gradient of its input (None on the first stage)."""
        with comm.phase("backward"):
            self.backward_step(mb, self.outputs.pop(key), g)
        if key not in self.caught:
            return None
        caught = self.caught.pop(key)
        assert "grad" in caught, f"micro-batch {key}: the backward did not reach the stage input"
        return caught["grad"]


def in_flight_slots(num_mb: int) -> int:
    """Micro-batches this stage holds between forward and backward at most under 1F1B (its warm-up plus one):
    micro-batch i + slots starts its forward only after micro-batch i's backward."""
    lay = state.layout()
    return max(1, min(lay.pp - lay.pp_rank, num_mb))


def one_f_one_b(
    num_mb: int,
    p2p: StageComm,
    forward_step: Callable[[int, torch.Tensor | None], torch.Tensor],
    backward_step: Callable[[int, torch.Tensor, torch.Tensor | None], None],
    in_flight=None,
) -> None:
    """Non-interleaved 1F1B: warm-up forwards, steady one-forward-one-backward, cool-down backwards.

    ``forward_step(i, input)`` returns the stage output (the scalar loss on the last stage);
    ``backward_step(i, output, grad)`` runs autograd from it. The input gradient that goes upstream
    is caught at the stage entry, so compact gradients never reach a leaf. A ``p2p`` of several chunks runs
    the interleaved schedule instead (``interleaved_1f1b``), with ``forward_step(i, input, chunk)``.
    ``in_flight``: what runs a micro-batch's forward and backward (default: eagerly, ``InFlight``; the trainer
    passes replayed CUDA graphs, ``cudagraph.StageGraphs``, with the same ``forward``/``backward``).
    """
    if p2p.chunks > 1:
        return interleaved_1f1b(num_mb, p2p, forward_step, backward_step)
    lay = state.layout()
    warmup = min(lay.pp - lay.pp_rank - 1, num_mb)
    mbs = in_flight if in_flight is not None else InFlight(forward_step, backward_step)
    fi = bi = 0
    for _ in range(warmup):
        y = mbs.forward(fi, fi, p2p.recv_forward())
        p2p.send_forward(y)
        fi += 1
    x = p2p.recv_forward() if num_mb > warmup else None
    for step in range(num_mb - warmup):
        y = mbs.forward(fi, fi, x)
        fi += 1
        g = p2p.send_forward_recv_backward(y) if not lay.is_last_stage else None
        gin = mbs.backward(bi, bi, g)
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
        gin = mbs.backward(bi, bi, g)
        bi += 1
        with comm.phase("backward"):
            p2p.send_backward(gin)


def interleaved_1f1b(
    num_mb: int,
    p2p: StageComm,
    forward_step: Callable[[int, torch.Tensor | None, int], torch.Tensor],
    backward_step: Callable[[int, torch.Tensor, torch.Tensor | None], None],
    in_flight: InFlight | None = None,
) -> None:
    """Megatron's interleaved 1F1B over this rank's ``p2p.chunks`` model chunks, step by step from
    ``interleaved.plan``: what arrives is filed under the (chunk, micro-batch) the plan names, so a received
    input or gradient waits in a dict until its chunk runs."""
    lay = state.layout()
    inputs: dict[interleaved.Key, torch.Tensor] = {}
    grads: dict[interleaved.Key, torch.Tensor] = {}
    gins: dict[interleaved.Key, torch.Tensor] = {}
    mbs = in_flight if in_flight is not None else InFlight(forward_step, backward_step)
    for st in interleaved.plan(lay.pp, lay.pp_rank, p2p.chunks, num_mb):
        if isinstance(st, interleaved.Comm):
            y = None if st.send_fwd is None else mbs.outputs[st.send_fwd]
            g = None if st.send_bwd is None else gins.pop(st.send_bwd)
            x, gout = p2p.send_recv(y, st.recv_fwd is not None, g, st.recv_bwd is not None)
            if st.recv_fwd is not None:
                inputs[st.recv_fwd] = x
            if st.recv_bwd is not None:
                grads[st.recv_bwd] = gout
            continue
        key = (st.chunk, st.mb)
        if st.kind == "F":
            mbs.forward(key, st.mb, inputs.pop(key, None), st.chunk)
        else:
            gin = mbs.backward(key, st.mb, grads.pop(key, None))
            if gin is not None:  # the first virtual stage has no input to send a gradient to
                gins[key] = gin


def forward_only(
    num_mb: int,
    p2p: StageComm,
    forward_step: Callable[[int, torch.Tensor | None, int], torch.Tensor],
    after: Callable[[int], None] | None = None,
) -> None:
    """Evaluation: each micro-batch through every chunk in virtual-stage order, then ``after(i)``; no backward.

    Round the ring a send waits only for the neighbour's next receive, so this needs no schedule."""
    lay = state.layout()
    for i in range(num_mb):
        for c in range(p2p.chunks):
            x = None if lay.is_first_stage and c == 0 else p2p.send_recv(None, True, None, False)[0]
            y = forward_step(i, x, c)
            if not (lay.is_last_stage and c == p2p.chunks - 1):
                p2p.send_recv(y, False, None, False)
        if after is not None:
            after(i)


def lockstep(
    num_mb: int,
    p2p: StageComm,
    forward_step: Callable[[int, torch.Tensor | None], torch.Tensor],
    backward_step: Callable[[int, torch.Tensor, torch.Tensor | None], None],
    slot: Callable[[int], None] | None = None,
    in_flight: InFlight | None = None,
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
    mbs = in_flight if in_flight is not None else InFlight(forward_step, backward_step)
    y = gin = None
    for p in range(num_mb + 2 * (P - 1)):
        fi, si, bi = p - r, p - (P - 1), p - 2 * (P - 1) + r
        do_f, do_b = 0 <= fi < num_mb, 0 <= bi < num_mb
        x, g = p2p.exchange(y, do_f, gin, do_b)
        y = gin = None
        if do_f:
            out = mbs.forward(fi, fi, x)
            y = None if lay.is_last_stage else out
        if slot is not None and 0 <= si < num_mb:
            slot(si)
        if do_b:
            gin = mbs.backward(bi, bi, g)
    # every stage's last input gradient crossed inside the loop, except the first stage's, which has no consumer
