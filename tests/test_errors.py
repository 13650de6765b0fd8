"""Bad input fails with one clear line and a non-zero exit, before any process group exists."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megasparse.config import ConfigError, load_config

TINY = [
    "data.prefix=synthetic",
    "model.vocab_size=64",
    "model.seq_length=8",
    "model.hidden_size=16",
    "model.num_attention_heads=2",
    "model.num_layers=2",
    "train.steps=1",
    "train.device=cpu",
    "parallel.backend=gloo",  # a GPU host would otherwise pick NCCL for these CPU tensors
]


def check(overrides, world, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(None, TINY + overrides).validate(world)
    assert "\n" not in str(e.value)


def test_world_size_must_factor():
    check(["parallel.tp=2", "parallel.pp=2"], 6, "does not factor")


def test_heads_divisible_by_tp():
    check(["model.num_attention_heads=2", "model.hidden_size=16", "parallel.tp=4"], 4, "num_attention_heads")


def test_kv_heads_divisible_by_tp():
    check(["model.num_attention_heads=4", "model.num_query_groups=1", "parallel.tp=2"], 2, "num_query_groups")


def test_hidden_divisible_by_heads():
    check(["model.num_attention_heads=3"], 1, "not divisible")


def test_more_stages_than_layers():
    check(["parallel.pp=4"], 4, "more pipeline stages")


def test_layer_split_must_sum():
    check(["parallel.pp=2", "parallel.layer_split=[1,2]"], 2, "layer_split")


def test_unknown_key_did_you_mean():
    with pytest.raises(ConfigError, match="did you mean 'hidden_size'"):
        load_config(None, ["model.hiden_size=3"])
    with pytest.raises(ConfigError, match="did you mean 'train'"):
        load_config(None, ["trian.steps=3"])


def test_choice_fields_list_the_options():
    check(
        ["filter.mode=colider"],
        1,
        r"filter.mode='colider': use one of off, loss_mask, collider \(did you mean 'collider'",
    )
    check(["train.dtype=bf32"], 1, "train.dtype='bf32': use one of auto, bf16, fp32")
    check(["train.device=gpu"], 1, "train.device='gpu': use one of auto, cuda, cpu")
    check(["parallel.backend=mpi"], 1, "parallel.backend='mpi': use one of auto, nccl, gloo")
    check(["sparsity.backend=cusparse"], 1, "sparsity.backend='cusparse'.*did you mean 'cusparselt'")
    check(["filter.granularity=token"], 1, "filter.granularity='token'")
    check(["filter.scorer=ppl"], 1, "filter.scorer='ppl'")
    check(["filter.reference=file"], 1, "filter.reference='file'")
    assert load_config(None, TINY + ["filter.mode=off"]).filter.mode == "off"  # YAML reads a bare off as False


def test_global_batch_divisible():
    check(["train.global_batch_size=6", "train.micro_batch_size=4"], 1, "global_batch_size")


def test_synthetic_data_needs_vocab():
    from megasparse.data.dataset import build_data

    with pytest.raises(ConfigError, match="needs model.vocab_size"):
        build_data(load_config(None, ["data.prefix=synthetic"]))


def run_cli(*args, env_extra=None):
    """``megasparse ARGS`` in a fresh process, with no rank variables but ``env_extra``'s (as from a user's shell)."""
    rank_env = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in rank_env}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "megasparse", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_cli_world_size_error_before_groups():
    r = run_cli("train", *TINY, "parallel.tp=2", env_extra={"WORLD_SIZE": "3", "RANK": "0"})
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("megasparse: error:") and "world size 3" in last


def test_cli_missing_dataset(tmp_path):
    r = run_cli(
        "train",
        *[t for t in TINY if not t.startswith("data.prefix")],
        f"data.prefix={tmp_path}/nope",
        f"data.tokenizer={tmp_path}/tok.json",
    )
    assert r.returncode == 2
    assert "megasparse: error:" in r.stderr.strip().splitlines()[-1]


def test_cli_resume_without_checkpoint(tmp_path):
    r = run_cli("train", *TINY, f"checkpoint.resume={tmp_path}", f"logging.out_dir={tmp_path}/out")
    assert r.returncode == 2
    assert "no valid checkpoint" in r.stderr.strip().splitlines()[-1]


def test_cli_unknown_command():
    r = run_cli("trian")
    assert r.returncode == 2 and "did you mean 'train'" in r.stderr
