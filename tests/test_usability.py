"""What a user types and reads: loss names (decision 0020), overrides anywhere on a command line, `megasparse plan`
without CUDA, `ref score --max-tokens`, and the start banner and per-step line (decision 0021)."""

from __future__ import annotations

import pytest

from megasparse.config import ConfigError, load_config
from megasparse.loss.config import LossConfig


@pytest.mark.parametrize(
    "override,fix",
    [("loss.impl=torch", "use loss.impl=materialized"), ("loss.backend=torch", "use loss.backend=reference")],
)
def test_old_loss_names_fail_with_the_new_one(override, fix):
    with pytest.raises(ConfigError, match=fix) as e:
        load_config(None, [override])
    assert "renamed" in str(e.value) and "\n" not in str(e.value)


def test_loss_built_in_code_with_an_old_name_fails_validation():
    with pytest.raises(ConfigError, match="use loss.impl=materialized"):
        LossConfig(impl="torch").validate()
    with pytest.raises(ConfigError, match="use loss.backend=reference"):
        LossConfig(backend="torch").validate()


def test_each_loss_choice_has_one_name():
    cfg = load_config(None, ["loss.impl=materialized", "loss.backend=reference"])
    cfg.loss.validate()
    assert (cfg.loss.impl, cfg.loss.backend) == ("materialized", "reference")
    assert cfg.loss.resolved_impl(8192, 64128) == "materialized"
    assert load_config(None, []).loss.resolved_impl(8192, 64128) == "materialized"  # auto, under the budget


# ---------------------------------------------------------------------------------- overrides anywhere on the line
def test_overrides_are_taken_after_options_and_other_tokens_still_fail():
    import argparse

    from megasparse.configbase import parse_with_overrides

    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--micro", default="1")
    ns = parse_with_overrides(p, ["c.yaml", "a.b=1", "--micro", "2", "c.d=x", "e.f=[1, 2]"])
    assert (ns.config, ns.micro, ns.overrides) == ("c.yaml", "2", ["a.b=1", "c.d=x", "e.f=[1, 2]"])
    for bad in (["c.yaml", "--micro", "2", "stray"], ["c.yaml", "--mciro", "2"]):
        with pytest.raises(SystemExit):
            parse_with_overrides(p, bad)


def test_bench_e2e_takes_overrides_after_its_options():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_e2e as be

    a = be.parse_args(["2gpu_8b_tp2sp", "--micro", "1", "train.steps=3", "--steps", "2", "model.num_layers=2"])
    assert (a.layout, a.micro, a.steps, a.overrides) == (
        "2gpu_8b_tp2sp",
        "1",
        2,
        ["train.steps=3", "model.num_layers=2"],
    )


def test_decay_search_takes_overrides_after_decays(monkeypatch, tmp_path, capsys):
    import megasparse.train
    from megasparse.sparse24 import cli

    seen = []

    def fake_run(cfg):  # the parsing is under test, not the training
        seen.append(cfg)
        return {"flip_rates": [{"all": 0.01 if cfg.sparsity.monitor_only else 0.008}], "losses": [1.0]}

    monkeypatch.setattr(megasparse.train, "run_training", fake_run)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  num_layers: 2\n")
    assert cli.main(["decay-search", str(cfg), "--decays", "1e-5", "model.hidden_size=64", "--window", "1"]) == 0
    assert len(seen) == 2 and all(c.model.hidden_size == 64 and c.model.num_layers == 2 for c in seen)
    assert "recommended sparsity.decay=1e-05" in capsys.readouterr().out


def test_plan_runs_a_gpu_config_without_cuda(capsys):
    from megasparse.parallel.planner import main

    assert main(["configs/gpu_gemma2b_pp2.yaml", "--dp", "2", "parallel.pp=2"]) == 0  # override after an option
    out = capsys.readouterr().out
    assert "tp 1 x pp 2 x dp 2" in out and "recommended: parallel.layer_split=" in out


def test_ref_score_needs_out_or_max_tokens(tmp_path, capsys):
    from megasparse.cli import main

    assert main(["ref", "score", str(tmp_path), str(tmp_path / "c.yaml"), "--data", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--out SIDECAR" in err and "--max-tokens N" in err and len(err.splitlines()) == 1


# ------------------------------------------------------------------------------------ banner and the step line
def _train_then_score(out: str, corpus: str, cfg_path: str, overrides: list[str]) -> tuple[str, str]:
    """One tiny CPU run's console, then `ref score --max-tokens` on its checkpoint (one process, one rank)."""
    import contextlib
    import io

    from megasparse.cli import main
    from megasparse.train import Trainer

    train_out = io.StringIO()
    with contextlib.redirect_stdout(train_out):
        Trainer(load_config(cfg_path, overrides)).fit()
    score_out = io.StringIO()
    with contextlib.redirect_stdout(score_out):
        rc = main(["ref", "score", out, cfg_path, "--data", corpus, "--max-tokens", "40", *overrides])
    assert rc == 0
    return train_out.getvalue(), score_out.getvalue()


def test_banner_and_step_line_say_what_is_on_and_where_the_run_is(tmp_path):
    import numpy as np
    from distributed import run_distributed
    from tiny import tiny

    from megasparse.data.indexed import write_indexed

    corpus = tmp_path / "corpus"
    rng = np.random.default_rng(0)
    write_indexed(corpus, [list(rng.integers(1, 250, size=30)) for _ in range(5)])
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train:\n  steps: 3\n")
    ov = tiny(
        parallel__tp=1, logging__out_dir=tmp_path / "run", filter__mode="collider", filter__keep_ratio=0.5,
        filter__scorer="loss", sparsity__enabled="true", sparsity__refresh_interval=1, optim__warmup_steps=1,
    )  # fmt: skip
    train, score = run_distributed(_train_then_score, 1, str(tmp_path / "run"), str(corpus), str(cfg), ov)[0]
    banner = train.split("\nstep ")[0]
    for field in (
        "tp 1 x pp 1 x dp 1", "sequence parallel off", "virtual stages 1",  # layout
        "filter     collider, keep ratio 0.50 (16 of 32 tokens", "loss       auto", "2:4        on",
        "graphs     off: not on CUDA",
    ):  # fmt: skip
        assert field in banner, (field, banner)
    steps = [line for line in train.splitlines() if line.startswith("step ")]
    assert [s.split(" |")[0] for s in steps] == ["step 1/3", "step 2/3", "step 3/3"]
    for field in ("ms/step", "ETA 0:00:", "kept 50%", "2:4 sparse", "GiB ("):
        assert field in steps[0], (field, steps[0])
    assert "128 tokens" in steps[0] and "384 tokens" in steps[2]  # 8 sequences x 16 tokens a step
    assert "2:4 dense" in steps[2]  # dense fine-tuning: the last sixth
    assert "none (--max-tokens" in score and score.splitlines()[-1].split()[0] == "40"


def test_banner_names_the_planners_layer_split_when_the_even_one_leaves_the_loss_stage_heavy():
    """The whole 8B at PP 2: the last stage's 128K-vocabulary loss is worth blocks, so on the even split the banner
    names the planner's [17, 15] (an estimated 5.5% shorter step) and layer_split=auto; a configured split, one stage,
    or a small vocabulary say nothing; auto, resolved, shows what it chose against the even split."""
    from pathlib import Path

    import torch

    from megasparse.banner import RunFacts, format_banner
    from megasparse.parallel.planner import resolve_layer_split

    def banner(overrides: list[str], vocab: int = 128256) -> str:
        cfg = load_config(str(Path(__file__).parent.parent / "configs" / "gpu_8b_pp2_dp2.yaml"), overrides)
        resolve_layer_split(cfg, vocab, 2)  # what build_model does
        facts = RunFacts(4, 2, vocab, vocab, torch.device("cpu"), torch.bfloat16, 16, None, 0.0, True, None)
        return format_banner(cfg, facts)

    hint = [line for line in banner(["parallel.layer_split=null"]).splitlines() if line.startswith("  pipeline")]
    assert len(hint) == 1 and "parallel.layer_split=[17,15]" in hint[0] and "5.5%" in hint[0], hint
    assert "parallel.layer_split=auto" in hint[0], hint
    assert "+3.6 GiB on the fullest stage" in hint[0], hint  # the planner: 63.2 -> 66.8 GiB; H200s: 63.5 -> 67.0
    even = ["parallel.layer_split=null"]
    for quiet in (["parallel.layer_split=[17,15]"], [*even, "parallel.pp=1"], [*even, "model.vocab_size=1024"]):
        assert "  pipeline" not in banner(quiet, 1024 if "vocab" in quiet[-1] else 128256), quiet
    auto = [line for line in banner([]).splitlines() if line.startswith("  pipeline")]
    assert auto == [
        "  pipeline   layer split [17, 15] (auto: planner, est. 5.5% shorter step than [16, 16], +3.6 GiB on the "
        "fullest stage)"
    ], auto
    small = banner(["model.vocab_size=1024"], 1024)
    assert "layer split [16, 16] (auto: planner, the even split is already the planner's best)" in small, small
