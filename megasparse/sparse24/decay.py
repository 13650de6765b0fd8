"""The 2:4 recipe's masked decay, g += λ·W·(1−M), as one Triton pass that needs no ``~M`` temporary.

Why: SR-STE's decay runs on every FFN weight before each optimizer step (when the fused optimizer step of
``optim.py`` does not apply: the distributed optimizer, a non-fused AdamW). In torch it is ``g.addcmul_(W, ~M)``:
building ``~M`` reads and writes a byte per element and allocates a weight-sized bool tensor, and the product reads
W, ``~M`` and g and writes g, 13 bytes per element with a bf16 W. The kernel reads g, W and M and writes g:
11 bytes (13 with an fp32 W), nothing allocated (decision 1236).

Exactness: the kernel forms ``(λ·W)·(1−M) + g`` in fp32. With 1−M in {0, 1} the product is either 0 or the rounded
λ·W, and with or without a fused multiply-add the sum is that value added to g with one rounding: what torch's
``addcmul_`` computes on the CPU, so the interpreter's run of the kernel is compared with it bit for bit. A CUDA
``addcmul_`` may fuse λ·W into the add (one rounding fewer): on the GPU the two agree within a rounding.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs without triton use the reference
    triton = None

BLOCK = 4096


def masked_decay_reference(g: torch.Tensor, w: torch.Tensor, mask: torch.Tensor, decay: float) -> None:
    """In place, in torch ops: g += decay·W·¬M (g fp32; W any float dtype; M bool, True where the weight is kept)."""
    g.addcmul_(w, ~mask, value=decay)


if triton is not None:

    @triton.jit
    def _masked_decay_kernel(g_ptr, w_ptr, mask_ptr, n, decay, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = offs < n
        g = tl.load(g_ptr + offs, mask=live, other=0.0)
        w = tl.load(w_ptr + offs, mask=live, other=0.0).to(tl.float32)
        drop = 1.0 - tl.load(mask_ptr + offs, mask=live, other=1).to(tl.float32)
        tl.store(g_ptr + offs, (decay * w) * drop + g, mask=live)


def masked_decay_triton(g: torch.Tensor, w: torch.Tensor, mask: torch.Tensor, decay: float) -> None:
    """The Triton pass (GPU, or under TRITON_INTERPRET): g fp32, W bf16/fp16/fp32, M bool, all contiguous and of
    one size (flat slices of whole tensors included)."""
    n = g.numel()
    if g.dtype != torch.float32 or w.numel() != n or mask.numel() != n or mask.dtype != torch.bool:
        raise ValueError(f"masked decay: g fp32, W and a bool M of g's size ({g.dtype} {n}, {w.numel()}, {mask.dtype})")
    if not (g.is_contiguous() and w.is_contiguous() and mask.is_contiguous()):
        raise ValueError("masked decay: g, W and M must be contiguous")
    if n == 0:
        return
    _masked_decay_kernel[(triton.cdiv(n, BLOCK),)](g, w, mask.view(torch.uint8), n, decay, BLOCK=BLOCK, num_warps=8)


def masked_decay_(g: torch.Tensor, w: torch.Tensor, mask: torch.Tensor, decay: float) -> None:
    """g += decay·W·¬M in place: the Triton pass on CUDA, the torch reference elsewhere (the CPU)."""
    if triton is not None and g.is_cuda:
        masked_decay_triton(g, w, mask, decay)
    else:
        masked_decay_reference(g, w, mask, decay)
