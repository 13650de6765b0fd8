"""One micro-batch's forward, selection and backward captured in a CUDA graph and replayed (``train.cuda_graphs``).

Why: at micro-batch 1 the eager step is host-bound. A TinyLlama micro-batch launches ~2,000 kernels (~2,400 with
the compact backward) through Python, autograd and the dispatcher; on an H100 the collider step spent 576 ms of
GPU time inside an 810–910 ms step. A replayed graph issues them all in one call. The compact backward is
capturable because nothing in it reads device values on the host (docs/decisions/0006) and its shapes are static.

What is captured, for a single-stage (pp = 1) CUDA run: token ids copied into a static buffer → model forward →
per-token loss summed into a static accumulator → selection → the backward, which accumulates into pre-allocated
``.grad`` tensors. Gradient reduction over DP, the norm, clipping and the optimizer step stay eager. The graph is
captured on the first training step after a few eager warm-up passes on a side stream (they compile kernels and
pick GEMM algorithms; their effects are zeroed), and replayed once per micro-batch of every step.

2:4 sparse FFNs: before each step's replays every sparse GEMM brings its operands up to date in place on the
host (``Sparse24Gemm.prepare_replay``); a mask refresh or the switch to dense fine-tuning changes the buffers the
GEMMs read, and the graph is captured again (every ``sparsity.refresh_interval`` steps).

Where it is not exact or not capturable, ``capture_blocker`` names why, and the trainer runs eagerly and logs it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture_blocker(cfg, pp: int, device: torch.device) -> str | None:
    """Why this run cannot use the captured micro-batch (None: it can)."""
    if not cfg.train.cuda_graphs:
        return "train.cuda_graphs=false"
    if device.type != "cuda":
        return "not on CUDA"
    if pp > 1:
        return "pipeline parallelism (stages exchange activations between micro-batches)"
    f = cfg.filter
    if f.mode != "off" and f.scorer == "random":
        return "filter.scorer=random draws from a generator seeded per micro-batch on the host"
    if f.mode != "off" and f.scorer == "excess" and f.reference != "model":
        return f"filter.reference={f.reference} looks reference losses up on the host"
    if f.mode != "off" and f.scorer == "excess":
        return "filter.reference=model runs a second model per micro-batch"
    if cfg.sparsity.enabled and cfg.sparsity.mvue:
        return "sparsity.mvue draws its random seeds on the host"
    if cfg.loss.impl == "cce":
        return "loss.impl=cce checks its targets on the host"
    if cfg.loss.vocab_over_pp:
        return "loss.vocab_over_pp"
    return None


class MicrobatchGraph:
    """``run_one(tokens)`` captured once, replayed for each micro-batch's tokens."""

    def __init__(
        self,
        run_one: Callable[[torch.Tensor], None],
        example: torch.Tensor,
        params: list[torch.nn.Parameter],
        loss_acc: torch.Tensor,
        warmup: int = 2,
    ):
        self.tokens = example.clone()
        self.loss_acc = loss_acc
        self.params = params
        for p in params:  # the backward must accumulate into tensors that outlive the capture
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                run_one(self.tokens)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            run_one(self.tokens)
        self.zero()

    def zero(self) -> None:
        """Clear what the warm-up passes accumulated (and before every step's first replay)."""
        torch._foreach_zero_([p.grad for p in self.params])
        self.loss_acc.zero_()

    def release(self) -> None:
        """Give the graph's private memory pool back (a trainer that is dropped while others run)."""
        self.graph.reset()

    def replay(self, tokens: torch.Tensor) -> None:
        self.tokens.copy_(tokens, non_blocking=True)
        self.graph.replay()
