"""loss.impl=mcore (megatron-core's own vocab-parallel cross-entropy) trains the same model as loss.impl=materialized
under TP=2 with sequence parallelism and a padded vocabulary (gloo); its config limits fail in one line."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from tiny import TRAINING, tiny

from megasparse.config import ConfigError, load_config

BASE = tiny(**TRAINING)


def _run(overrides: list[str]) -> dict:
    from megasparse.parallel.consolidate import full_state_dict
    from megasparse.train import Trainer

    tr = Trainer(load_config(None, BASE + overrides))
    tr.compute_gradients()
    grads = full_state_dict(tr.model, grads=True)
    losses = [tr.train_step().loss for _ in range(2)]
    return {"grads": grads, "losses": losses, "vocab_padded": tr.vocab_padded}


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True])
def test_mcore_loss_matches_torch_loss_tp2(sp):
    layout = ["parallel.tp=2", f"parallel.sequence_parallel={str(sp).lower()}"]
    ref = run_distributed(_run, 2, layout + ["loss.impl=materialized"])
    got = run_distributed(_run, 2, layout + ["loss.impl=mcore"])
    assert ref[0]["vocab_padded"] > 250  # the tiny vocabulary is padded: padding must not enter the loss
    for a, b in zip(got, ref):
        for x, y in zip(a["losses"], b["losses"]):
            assert abs(x - y) <= 1e-5 * abs(y)
        for name, g in b["grads"].items():
            assert torch.allclose(a["grads"][name], g, rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["loss.impl=mcore", "loss.softcap=30"], "loss.impl=mcore"),
        (["loss.impl=mcore", "filter.mode=collider"], "filter.mode=collider"),
        (["loss.impl=mcore", "loss.vocab_over_pp=true", "parallel.pp=2"], "loss.impl=mcore"),
    ],
)
def test_mcore_loss_limits_are_one_line_errors(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, tiny() + overrides).validate(2)
    assert key in str(e.value) and "\n" not in str(e.value)
