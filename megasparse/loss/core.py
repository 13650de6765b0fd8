"""The one loss core every output loss is built from (TP loss, pipeline-sliced loss; CCE and materialised maths).

Per token: loss = lse − target logit (+ z·lse²), 0 on ``ignore_index`` rows. A vocabulary slice contributes
partial (lse, target logit) statistics (``slice_stats``: merged by the caller's collective) and, given the merged
lse and the per-token loss gradient, its (dE, dC) (``slice_grads``). Which maths computes a slice is the backend
in ``LossOptions`` (``cce_launch.shard_forward``); which rows get a gradient is a ``KeepSpec``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from megasparse.loss.cce_launch import backend_for, shard_backward, shard_forward, vocab_order
from megasparse.loss.config import LossConfig, filter_threshold
from megasparse.loss.rows import local_targets, rows_or_all, rows_to_all, valid_rows
from megasparse.ops.compact import KeepHolder


@dataclass(frozen=True)
class LossOptions:
    """What the loss needs from LossConfig (resolved: impl, backend and filter threshold) plus the shard geometry."""

    n_valid: int
    vocab_start: int
    softcap: float | None = None
    z_loss: float = 0.0
    filter_eps: float | None = 2.0**-12
    sort_vocab: bool = False
    accum_fp32: bool = True
    """dE accumulated in fp32 and rounded once (``loss.grad_accum_fp32``, decision 0207)."""
    scratch_bytes: int | None = None
    """Bound on the exact backward's chunk buffer (``loss.cce_scratch_mb``); None: the kernels' own."""
    ignore_index: int = -100
    sequence_parallel: bool = False
    backend: str | None = None
    """gemm, triton (tile kernels), reference (chunked torch maths), materialized (whole logits: impl=materialized),
    or None (gemm on CUDA, reference on CPU)."""

    def backend_of(self, h: Tensor) -> str:
        """The backend that computes a slice held in ``h`` (the configured one, else the device's default)."""
        return self.backend or backend_for(h)

    def drops_ignored(self, backend: str) -> bool:
        """The tile kernels and the chunked reference drop ignored rows before any kernel; the GEMM and materialised
        backends zero their gradient instead (no host synchronisation), and so does every backend inside a CUDA-graph
        capture (finding the rows to drop reads the device on the host, which a captured step cannot:
        megasparse/cudagraph.py)."""
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        return backend in ("triton", "reference") and not capturing


@dataclass(frozen=True)
class KeepSpec:
    """Which rows get a gradient (every row still gets a loss).

    ``idx``: rows known at forward time (dense dE out, zero elsewhere). ``holder``: a ``KeepHolder`` whose
    ``meta`` the trainer's selection fills after the forward (compact dE of the kept rows out; an empty holder
    means a dense backward). Neither: every row."""

    idx: Tensor | None = None
    holder: KeepHolder | None = None

    @classmethod
    def of(cls, keep: KeepSpec | KeepHolder | Tensor | None) -> KeepSpec:
        """Normalise what callers pass (an index tensor, a holder, a spec or None)."""
        if isinstance(keep, KeepSpec):
            return keep
        if isinstance(keep, Tensor):
            return cls(idx=keep)
        return cls(holder=keep) if keep is not None else cls()

    @property
    def meta(self):
        """The holder's kept-row metadata once selection filled it (compact backward), else None."""
        return self.holder.meta if self.holder is not None else None


def token_loss(lse: Tensor, tgt: Tensor, z_loss: float) -> Tensor:
    """Per-token loss from merged statistics: lse − target logit + z·lse²."""
    loss = lse - tgt
    return loss + z_loss * lse * lse if z_loss else loss


def zloss_grad(g: Tensor, lse: Tensor, z_loss: float) -> Tensor:
    """Scale of the softmax part of the logit gradient: d(lse + z·lse²)/d lse = 1 + 2z·lse."""
    return g * (1 + 2 * z_loss * lse) if z_loss else g


Merge = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


def slice_stats(h: Tensor, w: Tensor, targets: Tensor, opt: LossOptions, merge: Merge) -> tuple[Tensor, Tensor, int]:
    """Merged per-token (lse, target logit) [n] over every slice (0 on dropped ignored rows) and the rows computed.

    Every rank builds the same targets, so every rank drops the same ignored rows before its kernels and the
    collective inside ``merge`` carries valid rows only."""
    n = h.shape[0]
    backend = opt.backend_of(h)
    rows = valid_rows(targets, opt.ignore_index) if opt.drops_ignored(backend) else None
    hv = rows_or_all(h, rows)
    tv = local_targets(rows_or_all(targets, rows), opt.vocab_start, opt.n_valid)
    lse_l, tgt_l = shard_forward(hv, w, tv, opt.n_valid, opt.softcap, backend)
    lse, tgt = merge(lse_l.float(), tgt_l.float())
    return rows_to_all(lse, rows, n), rows_to_all(tgt, rows, n), hv.shape[0]


def slice_grads(
    h: Tensor, w: Tensor, targets: Tensor, lse: Tensor, g: Tensor, opt: LossOptions, dc_out: Tensor | None = None
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(dE of the rows that count, this slice's dC, those rows' indices into ``h`` or None for all).

    ``h``/``targets``/``lse``/``g`` are the rows that get a gradient; ignored ones among them get none (dropped,
    or, in the materialised backend, kept with a zero gradient). ``dc_out``: dC is added into this fp32 buffer
    (the weight's gradient bucket slice) and returned as None."""
    backend = opt.backend_of(h)
    drop = opt.drops_ignored(backend)
    rows = valid_rows(targets, opt.ignore_index) if drop else None
    h, targets, lse, g = (rows_or_all(t, rows) for t in (h, targets, lse, g))
    if not drop:
        g = torch.where(targets != opt.ignore_index, g, torch.zeros_like(g))
    gs = zloss_grad(g, lse, opt.z_loss)
    sort = opt.sort_vocab and opt.filter_eps is not None and drop  # only the backends that drop rows filter
    perm = vocab_order(h, w, opt.n_valid) if sort else None
    t = local_targets(targets, opt.vocab_start, opt.n_valid)
    d_e, d_c = shard_backward(
        h, w, t, lse, gs, g, opt.n_valid, opt.softcap, opt.filter_eps, perm, opt.accum_fp32, backend, dc_out,
        opt.scratch_bytes,
    )  # fmt: skip
    return d_e, d_c, rows


def master_grad(d_c: Tensor | None, master: Tensor | None) -> Tensor | None:
    """dC as autograd wants it for the weight input: None once added into the master's bucket slice (``dc_out``),
    in the master's dtype when the loss read a compute-dtype operand, as computed otherwise."""
    return d_c if d_c is None or master is None else d_c.to(master.dtype)


def loss_options(
    cfg: LossConfig, impl: str, dtype, n_valid: int, vocab_start: int, ignore_index: int, sequence_parallel: bool
) -> LossOptions:
    """LossOptions of a resolved impl (cce or materialized): backend, filter threshold for ``dtype``, shard
    geometry."""
    if impl == "materialized":
        return LossOptions(
            n_valid=n_valid, vocab_start=vocab_start, softcap=cfg.softcap, z_loss=cfg.z_loss, filter_eps=None,
            ignore_index=ignore_index, sequence_parallel=sequence_parallel, backend="materialized",
        )  # fmt: skip
    return LossOptions(
        n_valid=n_valid, vocab_start=vocab_start, softcap=cfg.softcap, z_loss=cfg.z_loss,
        filter_eps=filter_threshold(cfg.filter_eps, dtype), sort_vocab=cfg.sort_vocab, accum_fp32=cfg.grad_accum_fp32,
        scratch_bytes=cfg.scratch_bytes, ignore_index=ignore_index, sequence_parallel=sequence_parallel,
        backend=cfg.backend,
    )  # fmt: skip
