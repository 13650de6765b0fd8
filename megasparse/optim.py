"""The optimizer side of a run: AdamW's parameter groups, the data-parallel wrapper that reduces gradients in buckets
and steps AdamW replicated or sharded over DP (``parallel/ddp.py``, ``parallel/dist_optim.py``), and the LR schedule.

Kept apart from ``model/builder.py`` (which builds models) so that the model builder, the trainer and tools that
only need a schedule each import what they use."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from megasparse.config import Config, OptimConfig
from megasparse.parallel import state
from megasparse.parallel.ddp import GradBuckets, backward_order
from megasparse.parallel.dist_optim import DataParallelOptimizer, DistributedAdamW

if TYPE_CHECKING:
    from megasparse.model.gpt import GPTStage

__all__ = ["build_data_parallel", "build_optimizer", "lr_at"]


def _decay_groups(model: torch.nn.Module, o: OptimConfig) -> list[tuple[list[torch.nn.Parameter], float]]:
    """Weight decay on matrices only (norm weights and other vectors are not decayed)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [(decay, o.weight_decay), (no_decay, 0.0)]


def build_optimizer(model: torch.nn.Module, o: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm weights and other vectors are not decayed)."""
    return torch.optim.AdamW(
        [{"params": ps, "weight_decay": wd} for ps, wd in _decay_groups(model, o)],
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        fused=device.type == "cuda",  # one kernel: 2.8x faster than foreach (H100, 1.1B params; decision 0009)
    )


def build_data_parallel(
    model: GPTStage, cfg: Config, device: torch.device, compute_dtype: torch.dtype, eager: bool
) -> DataParallelOptimizer:
    """Gradient buckets over DP and AdamW on them, replicated or sharded (``parallel.distributed_optimizer``).

    ``eager``: no CUDA graph will capture the backward, so buckets may start from its hooks (overlap); the sharded
    optimizer's parameters then become compute-dtype copies (bf16 on GPU) of its fp32 master chunks."""
    par, o = cfg.parallel, cfg.optim
    overlap = par.overlap_grad_reduce and state.layout().dp > 1 and eager
    sharded = par.distributed_optimizer
    buckets = GradBuckets(
        backward_order(model),
        cap=par.grad_bucket_numel,
        shard=sharded,
        overlap=overlap,
        align=64 if sharded else 1,  # 256-byte aligned fp32 chunks, 128-byte bf16 ones
        sequence_parallel=par.sequence_parallel,
    )
    if not sharded:
        return DataParallelOptimizer(model, buckets, build_optimizer(model, o, device), device)
    opt = DistributedAdamW(
        buckets,
        _decay_groups(model, o),
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        foreach=device.type == "cuda",
        fused=device.type == "cuda",  # one kernel over the owned pieces, as the replicated optimizer (decision 1238)
        param_dtype=compute_dtype,
        lazy_gather=overlap and not model.vocab_pp,  # the sliced vocabulary is read outside module forwards
    )
    if opt.lazy:
        opt.wait_before_use(model)
    return DataParallelOptimizer(model, buckets, opt, device)


def lr_at(cfg: Config, step: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup, then cosine decay to ``optim.min_lr``."""
    o, total = cfg.optim, cfg.train.steps
    if o.warmup_steps and step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    frac = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * min(1.0, frac)))
