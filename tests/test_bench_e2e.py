"""bench_e2e without a GPU: its modes are valid configs for every layout, the table and the plot read a report."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def test_every_mode_of_every_layout_is_a_valid_config() -> None:
    import bench_e2e as be

    from megasparse.config import load_config

    for name, (cfg_path, gpus, ov) in be.LAYOUTS.items():
        for mode, extra in be.ALL_MODES.items():
            # the layouts are GPU configs: validate their shapes here with the device question left to the GPU
            cpu = ["train.device=auto", "parallel.backend=auto"]
            cfg = load_config(str(be.ROOT / cfg_path), ov + extra + ["train.micro_batch_size=2"] + cpu)
            cfg.validate(gpus)
            assert cfg.model.seq_length == 4096, name
            if "collider" in mode:
                assert cfg.filter.mode == "collider" and cfg.filter.keep_ratio == 0.6
            if mode.startswith("loss="):
                assert cfg.loss.impl == mode.split("=")[1]
    assert set(be.MODES) < set(be.ALL_MODES)


def test_table_and_plot_from_a_report(tmp_path) -> None:
    import json

    import bench_e2e as be

    cases = []
    for mb in (1, 2):
        cases.append({"mode": be.ANCHOR, "micro_batch_size": mb, "step_ms": 100.0, "anchor_step_ms": 100.0,
                      "ratio_vs_anchor": 1.0, "ratio_vs_dense": None, "mfu": 0.4, "mem_gib": 10.0,
                      "host_syncs_per_step": 100})  # fmt: skip
        for i, mode in enumerate(be.MODES):
            ms = 90.0 - i
            cases.append({"mode": mode, "micro_batch_size": mb, "step_ms": ms, "anchor_step_ms": 100.0,
                          "ratio_vs_anchor": ms / 100, "ratio_vs_dense": ms / 90, "mfu": 0.5, "mem_gib": 9.0,
                          "host_syncs_per_step": 3})  # fmt: skip
    cases.append({"mode": "2:4", "micro_batch_size": 4, "error": "OutOfMemoryError: ..."})
    rep = {"device": "1x test", "layout": "1gpu_tinyllama", "shape": "tiny", "cases": cases}
    table = be.format_table(rep)
    assert table.splitlines()[-1].startswith("vs mcore")
    rep["loss_auto"] = ["loss.impl=auto -> cce: timed at 8x40"]
    assert be.format_table(rep).splitlines()[-1] == rep["loss_auto"][0]  # what auto ran, under the table
    assert "0.900" in table and "OutOfMemoryError" in table
    pytest.importorskip("matplotlib")
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps(rep))
    png = be.plot(str(path), str(tmp_path / "e2e.png"))
    assert Path(png).stat().st_size > 1000


def test_ratios_use_the_mean_of_first_and_repeated_runs() -> None:
    """A linear clock drift over one micro-batch's cases cancels: ratios are against the mean of both runs."""
    import bench_e2e as be

    runs = ((be.ANCHOR, 100.0), ("dense", 90.0), ("collider", 75.0), (be.ANCHOR, 104.0), ("dense", 94.0))
    cases = [{"mode": m, "step_ms": ms} for m, ms in runs]
    drift = be.settle_ratios(cases)
    assert cases[2]["ratio_vs_anchor"] == pytest.approx(75.0 / 102.0)
    assert cases[2]["ratio_vs_dense"] == pytest.approx(75.0 / 92.0)
    assert cases[0]["ratio_vs_dense"] is None and cases[1]["anchor_step_ms"] == pytest.approx(102.0)
    assert drift["anchor_drift"] == pytest.approx(0.04) and drift["dense_runs_ms"] == [90.0, 94.0]


def test_pair_names_split_at_the_colon_that_leaves_two_modes() -> None:
    import bench_pair as bp

    assert bp._split_pair("dense:2:4") == ("dense", "2:4")
    assert bp._split_pair("2:4:dense") == ("2:4", "dense")
    assert bp._split_pair("collider:collider+2:4") == ("collider", "collider+2:4")
    with pytest.raises(ValueError, match="use A:B"):
        bp._split_pair("dense:sparse")


def _pair_run(out: str) -> dict:
    import json

    import bench_pair as bp

    tiny = ["train.device=cpu", "parallel.backend=gloo", "train.dtype=fp32", "model.num_layers=2",
            "model.hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2",
            "model.ffn_hidden_size=128", "model.seq_length=32", "model.vocab_size=250", "train.global_batch_size=2",
            "train.eval_interval=0"]  # fmt: skip
    rc = bp.main(["1gpu_tinyllama", *tiny, "--pairs", "dense:collider", "--rounds", "3", "--out-dir", out])
    return {"rc": rc, "report": json.loads((Path(out) / "pair_1gpu_tinyllama.json").read_text())}


def test_pair_bench_times_both_trainers_in_rounds(tmp_path) -> None:
    """The paired bench runs both modes' trainers in one process on CPU and reports per-round ratios."""
    from distributed import run_distributed

    r = run_distributed(_pair_run, 1, str(tmp_path))[0]
    assert r["rc"] == 0
    (p,) = r["report"]["pairs"]
    assert (p["a"], p["b"], p["rounds"]) == ("dense", "collider", 3)
    assert p["a_ms"] > 0 and p["b_ms"] > 0 and p["ratio_min"] <= p["ratio_b_over_a"] <= p["ratio_max"]
    assert r["report"]["table"].splitlines()[-1].startswith("B/A")


def _profile_run(out: str) -> dict:
    import json

    import profile_step as ps

    tiny = ["train.device=cpu", "parallel.backend=gloo", "train.dtype=fp32", "model.num_layers=2",
            "model.hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2",
            "model.ffn_hidden_size=128", "model.seq_length=32", "model.vocab_size=250", "train.global_batch_size=2",
            "train.eval_interval=0"]  # fmt: skip
    args = ["--modes", "dense,collider", "--steps", "2", "--gpu-warmup-s", "0", "--tag", "cpu", "--out-dir", out]
    rc = ps.main(["1gpu_tinyllama", *tiny, *args])
    return {"rc": rc, "report": json.loads((Path(out) / "profile_1gpu_tinyllama_cpu.json").read_text())}


def test_profile_step_reports_each_mode(tmp_path) -> None:
    """The step profiler runs each mode's trainer on CPU and names its busiest host ops."""
    from distributed import run_distributed

    r = run_distributed(_profile_run, 1, str(tmp_path))[0]
    assert r["rc"] == 0
    cases = r["report"]["cases"]
    assert [c["mode"] for c in cases] == ["dense", "collider"]
    for c in cases:
        assert c["step_ms"] > 0 and c["host_self_cpu_ms"] > 0 and c["launches"] == 0  # no GPU: no launches
        assert c["top_host_ops"] and c["top_host_ops"][0]["self_cpu_ms"] >= c["top_host_ops"][-1]["self_cpu_ms"]
    assert r["report"]["table"].splitlines()[-1].startswith("*host ms")


def test_warmup_covers_the_2to4_autotune() -> None:
    """Timed steps start after 2:4's GEMM autotune (backend=auto), and only then."""
    import bench_trainer as bt

    from megasparse.config import load_config
    from megasparse.sparse24.converter import GemmAutotune

    sparse = load_config(None, ["sparsity.enabled=true", "sparsity.backend=auto"])
    assert bt.warmup_steps(sparse, 2) == GemmAutotune.STEPS_NEEDED and bt.warmup_steps(sparse, 20) == 20
    assert bt.warmup_steps(load_config(None, []), 2) == 2


def _measured_state(overrides: list[str]) -> tuple[float, int]:
    import bench_trainer as bt
    from tiny import TRAINING, tiny

    from megasparse.config import load_config
    from megasparse.train import Trainer

    tr = Trainer(load_config(None, tiny(**TRAINING) + overrides))
    tr.train_step()  # AdamW's moments exist from the first step on
    return bt.optimizer_state_gib(tr.dp_opt) * 2**30, tr.dp_opt.state_bytes()


@pytest.mark.slow
def test_bench_measures_the_optimizer_state_a_rank_holds() -> None:
    """The benchmarks' optimizer-state column reads the tensors' storages; it agrees with what the optimizers say
    they hold, replicated and sharded over dp = 2 (where it halves)."""
    from distributed import run_distributed

    replicated = run_distributed(_measured_state, 1, [])[0]
    sharded = run_distributed(_measured_state, 2, ["parallel.distributed_optimizer=true"])
    assert replicated[0] == pytest.approx(replicated[1], rel=0.02)
    assert sharded[0][0] == pytest.approx(sharded[0][1], rel=0.02)
    assert sharded[0][0] == pytest.approx(replicated[0] / 2, rel=0.03)


def test_anchor_schedule_follows_megatron_lms_defaults() -> None:
    """megatron-core's config defaults batch P2P and keep pipeline outputs; Megatron-LM frees the outputs and, with
    virtual stages, overlaps P2P with compute. The anchor must run the latter, or its interleaved rows flatter us."""
    pytest.importorskip("megatron.core")
    import mcore_anchor

    from megasparse.config import load_config

    plain = mcore_anchor.transformer_config(load_config(None, ["parallel.pp=2"]), "sdpa", recompute=False)
    vpp = ["parallel.pp=2", "parallel.virtual_stages=2", "model.num_layers=4", "train.global_batch_size=4"]
    inter = mcore_anchor.transformer_config(load_config(None, vpp), "sdpa", recompute=False)
    assert plain.deallocate_pipeline_outputs and inter.deallocate_pipeline_outputs
    assert (plain.batch_p2p_comm, plain.overlap_p2p_comm) == (True, False)
    assert (inter.batch_p2p_comm, inter.overlap_p2p_comm) == (False, True)
    assert inter.virtual_pipeline_model_parallel_size == 2 and plain.virtual_pipeline_model_parallel_size is None


def _auto_choices_on_ranks() -> list[str]:
    import bench_e2e as be

    import megasparse.loss as loss_pkg
    from megasparse.parallel import state

    state.init(1, 2, False, "gloo")  # PP=2: the loss (and auto's choice) lives on the last stage only
    if state.layout().pp_rank == 1:
        loss_pkg._log_choice("loss.impl=auto -> torch: a test-only reason")
    return be.auto_choices()


def test_auto_choices_come_from_the_rank_holding_the_loss() -> None:
    """Rank 0 writes the JSON but, under PP, holds no loss: the bench gathers auto's decisions from every rank."""
    from distributed import run_distributed

    got = run_distributed(_auto_choices_on_ranks, 2)
    assert got == [["loss.impl=auto -> torch: a test-only reason"]] * 2
