"""Activation recompute (``model.recompute``, decision 0012): saved activations traded for backward work.

Both levers act on what the forward *saves*, never on the gradients, so a ``CompactGrad`` flows through the backward
exactly as without recompute (no densification) and the recomputed tensors are bitwise the forward's (the model has
no dropout, so there is no RNG state to replay):

* ``full``: a layer's forward under torch's non-reentrant checkpoint. Its saved tensors are dropped and rebuilt by
  running the layer again when the backward first unpacks one; the backward still runs the forward's own autograd
  nodes (megasparse's Functions, with their compact paths).
* ``recomputed_when_saved``: a saved-tensor hook that stores, instead of one named activation, the input it is a
  cheap function of, and rebuilds it at unpack (the SwiGLU output that fc2 saves, rebuilt from fc1's output).

The attention's own part of the selective mode (its rotated q/k) lives in ``ops/attention.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint


def full(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    """``fn(*args)``, keeping only ``args`` for the backward: what ``fn`` saves is rebuilt by running it again.

    Non-reentrant (gradients, compact ones included, go through the forward's graph untouched; it works inside a
    captured CUDA graph); no RNG state is saved or restored (nothing in a layer draws random numbers)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)


class _Rebuild:
    """What a save of the named activation keeps instead: the input and the function that rebuilds it."""

    __slots__ = ("fn", "arg", "shape")

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], arg: torch.Tensor, shape: torch.Size):
        self.fn, self.arg, self.shape = fn, arg, shape

    def value(self) -> torch.Tensor:
        with torch.no_grad():
            return self.fn(self.arg).view(self.shape)


@contextmanager
def recomputed_when_saved(
    out: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], arg: torch.Tensor
) -> Iterator[None]:
    """Inside the block, an autograd save of ``out`` (or of a same-size contiguous view of it) keeps ``arg`` and
    ``fn`` instead, and the backward gets ``fn(arg)`` when it unpacks it. ``out`` must equal ``fn(arg)`` bitwise
    (a deterministic elementwise function). Every other saved tensor is kept as usual."""
    if not (torch.is_grad_enabled() and out.is_contiguous()):
        yield
        return
    ptr, n = out.data_ptr(), out.numel()

    def pack(t: torch.Tensor):
        if t.data_ptr() == ptr and t.numel() == n and t.is_contiguous():
            return _Rebuild(fn, arg, t.shape)
        return t

    def unpack(p):
        return p.value() if isinstance(p, _Rebuild) else p

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
