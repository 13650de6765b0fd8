"""A run stopped at step N and resumed from its sharded checkpoint continues exactly like the uninterrupted run."""

from __future__ import annotations

import pytest
from distributed import run_distributed

BASE = [
    "data.prefix=synthetic",
    "model.vocab_size=128",
    "model.seq_length=16",
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.num_layers=2",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.dtype=fp32",
    "train.device=cpu",
    "train.eval_interval=0",
    "train.steps=6",
    "optim.warmup_steps=2",
    "parallel.backend=gloo",  # a GPU host would otherwise pick NCCL for these CPU tensors
]


def losses(overrides: list[str], stop_at: int | None, resume: str | None) -> list[float]:
    from megasparse.config import load_config
    from megasparse.train import Trainer

    ov = BASE + overrides + ([f"checkpoint.resume={resume}"] if resume else [])
    tr = Trainer(load_config(None, ov))
    if resume:
        tr.resume(resume)
    out = []
    while tr.step < (stop_at or tr.cfg.train.steps):
        out.append(tr.train_step().loss)
    if stop_at:
        tr.save()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.pp=2"]])
def test_resume_reproduces_losses(tmp_path, layout):
    out = [f"logging.out_dir={tmp_path}"] + layout
    full = run_distributed(losses, 2, out, None, None)[0]
    first = run_distributed(losses, 2, out, 3, None)[0]
    assert (tmp_path / "checkpoints" / "step-3" / ".metadata").exists()
    assert not list((tmp_path / "checkpoints").glob(".tmp-*")), "temporary save directory left behind"
    rest = run_distributed(losses, 2, out, None, str(tmp_path))[0]
    assert first == full[:3]
    assert len(rest) == 3
    for a, b in zip(rest, full[3:]):
        assert abs(a - b) <= 1e-6 * abs(b), (rest, full)
