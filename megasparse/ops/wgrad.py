"""Weight gradients added straight into the fp32 gradient buckets (Megatron's gradient-accumulation fusion).

Every trainable weight's fp32 gradient lives in a bucket slice, ``main_grad`` (``parallel/ddp.py``). A layer that
computes its weight gradient in the compute dtype and hands it to autograd pays a compute-dtype product, a cast to
fp32 and a separate add per micro-batch. ``accumulate_mm`` writes the product into the fp32 slice in one GEMM
instead; ``grad_buffer`` says when a weight's gradient may go there (decision 0009). Used by the linear layers, the
2:4 GEMMs and the output layer's loss.
"""

from __future__ import annotations

import torch

__all__ = ["accumulate_mm", "grad_buffer"]

_FUSED_ADDMM: list[bool] = []  # whether torch.addmm(out_dtype=) accumulates in place here (probed once)


def accumulate_mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a·b with fp32 ``out`` and bf16 ``a``, ``b``: one GEMM with fp32 output and beta = 1 on CUDA (no
    compute-dtype product, no cast, no separate add), an in-place addmm when the dtypes agree."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
        return
    if a.is_cuda and _FUSED_ADDMM != [False]:
        try:
            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
            _FUSED_ADDMM[:] = [True]
            return
        except torch.OutOfMemoryError:  # says nothing about the API: keep the fused path for the next call
            raise
        except (TypeError, RuntimeError):  # torch without addmm(out_dtype=): the separate add below
            _FUSED_ADDMM[:] = [False]
    out.add_(a @ b)


def grad_buffer(weight: torch.Tensor | None) -> torch.Tensor | None:
    """The fp32 bucket slice a gradient of ``weight`` may be added into directly, or None.

    A parameter in another dtype (the distributed optimizer's compute copies) always routes through ``main_grad``;
    an fp32 parameter only while its ``.grad`` is that slice (the buckets install it at every ``zero``; a test or a
    user that detached it gets an ordinary autograd gradient). Whoever adds into the slice returns None to autograd,
    whose post-accumulate hook (the bucket's arrival count) still fires."""
    main = getattr(weight, "main_grad", None)
    if main is None:
        return None
    if weight.dtype != torch.float32:
        return main
    grad = weight.grad
    return main if grad is not None and grad.data_ptr() == main.data_ptr() else None
