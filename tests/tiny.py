"""The tiny synthetic-data CPU config the multi-process tests share, as dotted overrides."""

from __future__ import annotations

DEFAULTS = {
    "data.prefix": "synthetic", "model.vocab_size": 250, "model.seq_length": 16, "model.hidden_size": 64,
    "model.num_attention_heads": 4, "model.num_query_groups": 2, "model.num_layers": 4, "model.ffn_hidden_size": 128,
    "train.micro_batch_size": 2, "train.global_batch_size": 8, "train.dtype": "fp32", "train.device": "cpu",
    "train.eval_interval": 0, "parallel.backend": "gloo",
}  # fmt: skip
"""``parallel.backend=gloo``: CPU tensors on every host (``auto`` picks NCCL on a GPU machine)."""

# Adam with a tiny eps turns float-rounding-sized gradient differences of near-zero entries into whole-lr
# steps of opposite sign; eps=1e-4 keeps weight comparisons well-conditioned (at most 100x amplification)
# without hiding real differences, which show up at the 1e-2 level.
TRAINING = {"optim__lr": 1e-2, "optim__min_lr": 1e-3, "optim__eps": 1e-4, "optim__warmup_steps": 2}


def tiny(**changes) -> list[str]:
    """Overrides for the shared tiny config; keyword keys use '__' for '.', e.g. model__num_layers=3."""
    cfg = {**DEFAULTS, **{k.replace("__", "."): v for k, v in changes.items()}}
    return [f"{k}={v}" for k, v in cfg.items()]
