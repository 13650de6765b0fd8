"""The online reference-model source and checkpoint scoring (`ref score`'s model side)."""

from __future__ import annotations

import torch
from distributed import run_distributed

TINY = [
    "data.prefix=synthetic",
    "model.vocab_size=64",
    "model.seq_length=16",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.num_layers=2",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.device=cpu",
    "parallel.backend=gloo",
    "train.dtype=fp32",
    "train.eval_interval=0",
]


def train_ref(out: str) -> None:
    from megasparse.config import load_config
    from megasparse.train import Trainer

    Trainer(load_config(None, TINY + ["train.steps=2", f"logging.out_dir={out}"])).fit()


def filtered_with_model_ref(out: str, tp: int) -> float:
    from megasparse.config import load_config
    from megasparse.train import Trainer

    tr = Trainer(
        load_config(
            None,
            TINY
            + [
                f"parallel.tp={tp}",
                "filter.mode=collider",
                "filter.scorer=excess",
                "filter.reference=model",
                f"filter.ref_checkpoint={out}",
            ],
        )
    )
    return tr.train_step().loss


def scored(out: str) -> torch.Tensor:
    from megasparse.config import load_config
    from megasparse.model.builder import load_model_for_inference

    model = load_model_for_inference(load_config(None, TINY), out)
    tokens = torch.randint(0, 64, (16, 3), generator=torch.Generator().manual_seed(0))
    return model.token_losses(tokens)


def test_model_reference_and_scoring(tmp_path):
    run_distributed(train_ref, 1, str(tmp_path))
    loss = run_distributed(filtered_with_model_ref, 1, str(tmp_path), 1)[0]
    assert torch.isfinite(torch.tensor(loss))
    s = run_distributed(scored, 1, str(tmp_path))[0]
    assert s.shape == (16, 3) and torch.all(s[0] == 0) and torch.all(s[1:] > 0)


def config_unchanged_by_inference(out: str) -> bool:
    import copy

    from megasparse.config import load_config
    from megasparse.model.builder import load_model_for_inference

    cfg = load_config(None, TINY + ["parallel.sequence_parallel=true", "filter.mode=loss_mask"])
    before = copy.deepcopy(cfg)
    load_model_for_inference(cfg, out)
    return cfg == before


def test_load_model_for_inference_leaves_the_config_alone(tmp_path):
    run_distributed(train_ref, 1, str(tmp_path))
    assert run_distributed(config_unchanged_by_inference, 1, str(tmp_path))[0]
