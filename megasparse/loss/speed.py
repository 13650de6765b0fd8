"""``loss.impl=auto``'s speed check: CCE where it is as fast as the materialised loss (issue 12).

Which loss is faster depends on the shape and the GPU. CCE recomputes the logits in its backward (2·N·V·D more FLOPs)
but never passes over [N, V] fp32 logits. It won the TinyLlama step on one H100 (D 2048: 0.95–0.97× the step) and lost
the Llama-3-8B kernel (D 4096: 1.10–1.19×), decision 0203. A fixed rule would be wrong on the next GPU, so auto times
both, once per shape, when the materialised logits fit ``loss.materialize_budget_gib``.

The check runs the loss maths of this rank's shard, forward and backward, on synthetic data of the real shape
(rows, local vocabulary, hidden, dtype): one warm-up and ``REPEATS`` timed passes each, on the current stream. It
needs no collective: the two losses share their merge and dE collectives. TP ranks then agree by taking each time's
maximum over the TP group, so every shard runs the same loss. The choice is cached per shape and logged once with
both times. A check that fails (out of memory, a kernel error) says why once and keeps the memory rule's choice on
every TP rank. A step being captured into a CUDA graph never runs it (the trainer's eager warm-up passes do), nor
does a forward without autograd (evaluation, reference scoring: their row counts vary).

What it costs: a few host synchronisations (one per timed pass) and a few passes of the loss, once per run and shape.
What it does not give: a pinned choice. Timings are noisy, so two runs (or a resumed run, which times again) may
pick differently near a tie, and DP replicas decide per TP group. Both losses are exact, so only the rounding
differs; pin ``loss.impl=cce`` or ``materialized`` where bitwise reproducibility across runs matters.
"""

from __future__ import annotations

import logging
import math
import time

import torch
import torch.distributed as dist
from torch import Tensor

from megasparse.loss.config import LossConfig
from megasparse.loss.core import loss_options, slice_grads, slice_stats, token_loss
from megasparse.parallel import comm

log = logging.getLogger(__name__)

REPEATS = 3
_CHOICES: dict[tuple, tuple[str, str]] = {}


def _no_merge(lse: Tensor, tgt: Tensor) -> tuple[Tensor, Tensor]:
    return lse, tgt


def time_loss(impl: str, cfg: LossConfig, rows: int, width: int, hidden: int, dtype, device, n_valid: int) -> float:
    """Median seconds of one forward + backward of this shard's loss maths under ``impl`` (cce or materialized)."""
    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(rows, hidden, generator=gen, device=device, dtype=dtype)
    w = torch.randn(width, hidden, generator=gen, device=device, dtype=dtype).mul_(hidden**-0.5)
    t = torch.randint(0, max(n_valid, 1), (rows,), generator=gen, device=device)
    g = torch.full((rows,), 1.0 / rows, device=device)
    opt = loss_options(cfg, impl, dtype, n_valid, 0, -100, False)

    def once() -> None:
        lse, tgt, _ = slice_stats(h, w, t, opt, _no_merge)
        token_loss(lse, tgt, opt.z_loss)
        slice_grads(h, w, t, lse, g, opt)

    cuda = torch.device(device).type == "cuda"
    once()
    times = []
    for _ in range(REPEATS):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            once()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            once()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def timed_choice(
    cfg: LossConfig, rows: int, width: int, hidden: int, dtype, device, n_valid: int, group, fallback: tuple[str, str]
) -> tuple[str, str]:
    """(impl, why): cce when its measured time is at most the materialised loss's, materialized otherwise; ``fallback``
    (the memory rule's answer) when the check cannot run. Cached per shape: the first call decides for the run."""
    # every option the timed losses read, resolved (LossOptions is frozen): a new loss key cannot be left out here
    key = (rows, width, hidden, dtype, str(device), loss_options(cfg, "cce", dtype, n_valid, 0, -100, False))
    if key in _CHOICES:
        return _CHOICES[key]
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return fallback  # not cached: the eager pass after the capture decides
    failed, secs = "", []
    for impl in ("materialized", "cce"):  # each timed alone: the materialised logits may not fit where cce does
        try:
            secs.append(time_loss(impl, cfg, rows, width, hidden, dtype, device, n_valid))
        except Exception as e:  # a speed check must never stop a run
            if isinstance(e, torch.OutOfMemoryError) and torch.cuda.is_available():
                torch.cuda.empty_cache()
            failed = failed or f"{impl}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            secs.append(math.inf)
    if group is not None:  # every TP rank joins, failed or not; inf from any rank counts on every rank
        both = torch.tensor(secs, dtype=torch.float64, device=device)
        comm.all_reduce(both, group, "tp", op=dist.ReduceOp.MAX, region="loss.speed_check")
        secs = both.tolist()
    if not math.isfinite(secs[0]) and math.isfinite(secs[1]):  # the materialised loss failed (out of memory)
        choice = (
            "cce",
            f"loss.impl=auto -> cce: the materialised loss failed its speed check ({failed or 'on another TP rank'})",
        )
        _CHOICES[key] = choice
        return choice
    if not all(math.isfinite(x) for x in secs):
        choice = (fallback[0], f"{fallback[1]} (speed check failed: {failed or 'on another TP rank'})")
        _CHOICES[key] = choice
        return choice
    t_mat, t_cce = secs
    impl = "cce" if t_cce <= t_mat else "materialized"
    sizes = f"{rows}x{width}, hidden {hidden}"
    why = f"loss.impl=auto -> {impl}: timed at {sizes}: cce {t_cce * 1e3:.2f} ms, materialised {t_mat * 1e3:.2f} ms"
    _CHOICES[key] = (impl, why)
    return impl, why
