"""bench_e2e without a GPU: its modes are valid configs for every layout, the table and the plot read a report."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def test_every_mode_of_every_layout_is_a_valid_config() -> None:
    import bench_e2e as be

    from megasparse.config import ConfigError, load_config

    for name, (cfg_path, gpus, ov) in be.LAYOUTS.items():
        for mode, extra in be.ALL_MODES.items():
            # the layouts are GPU configs: validate their shapes here with the device question left to the GPU
            cpu = ["train.device=auto", "parallel.backend=auto"]
            try:
                cfg = load_config(str(be.ROOT / cfg_path), ov + extra + ["train.micro_batch_size=2"] + cpu)
            except ConfigError as e:  # issue 33's fp8 modes, on a checkout without train.fp8
                assert "train.fp8=tensorwise" in extra and "'train.fp8'" in str(e), (name, mode, e)
                continue
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
    assert "*" not in table and "mem GiB*" not in table
    cases[1]["leftover_gib"] = 7.5  # a row whose peak left out what an earlier case held is marked, and said why
    marked = be.format_table(rep)
    assert "9.00*" in marked and "mem GiB*: the case started with 7.5 GiB" in marked
    head, row = marked.splitlines()[1], marked.splitlines()[4]
    assert len(row) == len(head), (head, row)  # the mark takes no column of its own
    del cases[1]["leftover_gib"]
    pytest.importorskip("matplotlib")
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps(rep))
    png = be.plot(str(path), str(tmp_path / "e2e.png"))
    assert Path(png).stat().st_size > 1000
    for c in cases:  # the throughput plot: tokens/s/GPU of every run, an anchor among them; error rows skipped
        c.setdefault("tokens_per_s_per_gpu", 1e5 / c.get("step_ms", 1.0))
    cases.append({"mode": "torchtitan-fp8", "micro_batch_size": 1, "step_ms": 80.0, "tokens_per_s_per_gpu": 1250.0})
    path.write_text(json.dumps(rep))
    png = be.plot_throughput([str(path), str(path)], str(tmp_path / "tp.png"))
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


def test_profile_timeline_splits_a_step_into_compute_exposed_comm_and_idle() -> None:
    """From a chrome trace: compute on two streams merged, NCCL counted only where no compute runs beside it, the
    GPU's idle time, and the longest compute gap named by the kernels around it."""
    import profile_step as ps

    def k(name: str, ts: float, dur: float, stream: int = 7) -> dict:
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}

    trace = {"traceEvents": [
        k("gemm_a", 0, 100), k("gemm_b", 50, 100, stream=9),  # compute 0-150 on two streams
        k("ncclDevKernel_ReduceScatter", 120, 80, stream=20),  # 150-200 of it exposed
        k("gemm_c", 260, 40),  # GPU idle 200-260; compute gap 150-260 after gemm_b
        k("gemm_d", 310, 10),  # a shorter gap, 300-310
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 999},  # host events do not count
    ]}  # fmt: skip
    t = ps.timeline(trace, gaps=2)
    assert t["span_ms"] == pytest.approx(0.32) and t["compute_busy_ms"] == pytest.approx(0.2)
    assert t["exposed_comm_ms"] == pytest.approx(0.05) and t["idle_ms"] == pytest.approx(0.07)
    assert [(g["after"], g["before"]) for g in t["compute_gaps"]] == [("gemm_b", "gemm_c"), ("gemm_c", "gemm_d")]
    assert t["compute_gaps"][0]["ms"] == pytest.approx(0.11)
    assert ps.timeline({"traceEvents": []}) == {}


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
    # a configured (or auto-resolved) 1F1B split reaches megatron-core: [17, 15] is not compared with its [16, 16]
    split = load_config(None, ["parallel.pp=2", "model.num_layers=32", "parallel.layer_split=[17,15]"])
    uneven = mcore_anchor.transformer_config(split, "sdpa", recompute=False)
    assert (uneven.num_layers_in_first_pipeline_stage, uneven.num_layers_in_last_pipeline_stage) == (17, 15)
    assert plain.num_layers_in_first_pipeline_stage is None


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


def test_whole_8b_layouts_are_llama3_8b_on_four_gpus() -> None:
    """Issue 33's layouts: the whole Llama-3-8B (torchtitan's count: 8.03 B parameters) at seq 4096 and global batch
    32 on 4 GPUs in each megasparse layout, the data-parallel ones with the distributed optimizer; torchtitan's MFU
    numerator equals megasparse's for it; the torchtitan anchors run by default where the issue compares."""
    import bench_e2e as be
    import titan_anchor as ta

    from megasparse.config import load_config
    from megasparse.metrics import flops_per_token

    layouts = {}
    for name in ("4gpu_8b32l", "4gpu_8b32l_tp2sp_dp2", "4gpu_8b32l_pp2_dp2", "4gpu_8b32l_pp2v2_dp2", "4gpu_8b32l_dp4"):
        cfg_path, gpus, ov = be.LAYOUTS[name]
        cfg = load_config(str(be.ROOT / cfg_path), ov + ["train.micro_batch_size=2", "train.device=auto"])
        cfg.validate(gpus)
        p, m = cfg.parallel, cfg.model
        assert gpus == 4 and (m.num_layers, m.hidden_size, m.ffn_size, m.kv_heads) == (32, 4096, 14336, 8)
        assert (m.vocab_size, m.seq_length, cfg.train.global_batch_size) == (128256, 4096, 32)
        assert p.distributed_optimizer == (p.tp * p.pp < 4)
        layouts[name] = (p.tp, p.pp, p.sequence_parallel)
    assert layouts == {"4gpu_8b32l": (2, 2, True), "4gpu_8b32l_tp2sp_dp2": (2, 1, True),
                       "4gpu_8b32l_pp2_dp2": (1, 2, False), "4gpu_8b32l_pp2v2_dp2": (1, 2, False),
                       "4gpu_8b32l_dp4": (1, 1, False)}  # fmt: skip
    v2 = load_config(str(be.ROOT / be.LAYOUTS["4gpu_8b32l_pp2v2_dp2"][0]), be.LAYOUTS["4gpu_8b32l_pp2v2_dp2"][2])
    assert v2.parallel.virtual_stages == 2 and v2.model.recompute == "selective"
    assert ta.titan_param_count(m) == (8_030_261_248, 128256 * 4096)
    assert ta.titan_flops_per_token(m) == pytest.approx(flops_per_token(m, 128256), rel=1e-6)
    ns = be.parse_args(["4gpu_8b32l"])
    assert be.parse_anchors(ns) == list(be.ANCHORS) and be.parse_anchors(be.parse_args(["2gpu_8b_pp2"])) == [be.ANCHOR]
    assert be.parse_anchors(be.parse_args(["1gpu_8b4l", "--anchors", ""])) == []
    assert be.parse_anchors(be.parse_args(["1gpu_8b4l", "--anchors", "torchtitan"])) is None


def _e2e_smoke(out: str) -> dict:
    import json

    import bench_e2e as be

    tiny = ["train.device=cpu", "parallel.backend=gloo", "train.dtype=fp32", "model.num_layers=2",
            "model.hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2",
            "model.ffn_hidden_size=128", "model.seq_length=32", "model.vocab_size=250", "train.global_batch_size=2",
            "train.eval_interval=0"]  # fmt: skip
    args = ["--modes", "dense,fp8", "--micro", "1", "--steps", "1", "--warmup", "1", "--gpu-warmup-s", "0"]
    rc = be.main(["1gpu_8b4l", *tiny, *args, "--no-repeat", "--out-dir", out])
    return {"rc": rc, "report": json.loads((Path(out) / "e2e_1gpu_8b4l.json").read_text())}


def test_cpu_smoke_reports_skipped_anchors_and_unavailable_modes(tmp_path) -> None:
    """On CPU the anchors are skipped rows; a mode whose key this checkout lacks (fp8 before train.fp8 exists) is an
    error row while the others run; the JSON is final (not partial) and each timed row names its call."""
    import bench_e2e as be
    from distributed import run_distributed

    r = run_distributed(_e2e_smoke, 1, str(tmp_path))[0]
    rows = {c["mode"]: c for c in r["report"]["cases"]}
    assert set(rows) == {"dense", *be.ANCHORS, "fp8"} and len(rows) == len(r["report"]["cases"])
    assert all(rows[a]["error"] == "needs CUDA (skipped)" for a in be.ANCHORS)
    assert rows["dense"]["step_ms"] > 0 and rows["dense"]["call"] == r["report"]["call"]
    assert r["report"]["partial"] is False
    fp8_ok = "error" not in rows["fp8"]  # the fp8 branch merged: the mode runs like any other
    assert fp8_ok or ("ConfigError" in rows["fp8"]["error"] and r["rc"] == 1)


def test_merged_calls_get_ratios_against_torchtitan(tmp_path) -> None:
    """Two calls' JSONs (anchors, then megasparse modes) merge into one; rows are compared with torchtitan's at the
    same micro-batch, flagged when that row came from the other call; a later call's row replaces an equal one."""
    import json

    import bench_e2e as be

    def row(mode, mb, ms, call):
        return {"mode": mode, "micro_batch_size": mb, "step_ms": ms, "mem_gib": 1.0, "host_syncs_per_step": 1,
                "call": call}  # fmt: skip

    first = [row("torchtitan-bf16", 1, 200.0, "a"), row("torchtitan-fp8", 1, 160.0, "a"), row("dense", 1, 190.0, "a")]
    second = [row("dense", 1, 180.0, "b"), row("dense", 2, 170.0, "b"),
              {"mode": "fp8", "micro_batch_size": 1, "error": "ConfigError: ..."}]  # fmt: skip
    paths = []
    for call, cases in (("a", first), ("b", second)):
        rep = {"device": "4x H100", "layout": "4gpu_8b32l", "shape": "8B", "call": call, "cases": cases}
        paths.append(tmp_path / f"{call}.json")
        paths[-1].write_text(json.dumps(rep))
    assert be.main(["--merge", *map(str, paths), "--out-dir", str(tmp_path / "m")]) == 0
    merged = json.loads((tmp_path / "m" / "e2e_4gpu_8b32l.json").read_text())
    rows = {(c["mode"], c["micro_batch_size"]): c for c in merged["cases"]}
    dense = rows[("dense", 1)]
    assert dense["step_ms"] == 180.0 and merged["calls"] == ["a", "b"] and len(merged["cases"]) == 5
    assert dense["ratio_vs_titan_bf16"] == pytest.approx(0.9) and dense["ratio_vs_titan_fp8"] == 1.125
    assert dense["titan_other_call"] and "titan_other_call" not in rows[("torchtitan-fp8", 1)]
    assert "ratio_vs_titan_bf16" not in rows[("dense", 2)] and "ratio_vs_titan_fp8" not in rows[("fp8", 1)]
    assert "vs tt-fp8" in merged["table"] and "1.125" in merged["table"]


def test_titan_stubs_stand_in_and_refuse(monkeypatch) -> None:
    """Where ``datasets`` / tensorboard are missing, torchtitan's module-level imports get inert stand-ins that raise
    when used; installing twice is a no-op (the second torchtitan case of a call)."""
    import titan_anchor as ta

    names = ("datasets", "datasets.distributed", "torch.utils.tensorboard")
    saved = {n: sys.modules.get(n) for n in names}
    monkeypatch.setattr(ta.importlib.util, "find_spec", lambda name: None)  # as on the GPU image
    try:
        for n in names:
            sys.modules.pop(n, None)
        assert ta.install_import_stubs() == ["datasets", "torch.utils.tensorboard"]
        assert ta.install_import_stubs() == []
        from datasets.distributed import split_dataset_by_node
        from torch.utils.tensorboard import SummaryWriter

        with pytest.raises(RuntimeError, match="stub"):
            SummaryWriter("x")
        with pytest.raises(RuntimeError, match="stub"):
            split_dataset_by_node(None, 0, 1)
    finally:
        for n, mod in saved.items():
            if mod is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = mod


def test_titan_builds_the_configs_model() -> None:
    """With torchtitan installed (the [bench] extra; not in CI): its Llama-3 with our arguments is the 8B, its own
    FLOP count is ours, and the JobConfig asks for compile, FSDP everywhere, bf16 and float8 without the output."""
    pytest.importorskip("torchtitan", reason="torchtitan is a [bench] extra")
    import titan_anchor as ta
    import torch

    from megasparse.config import load_config

    cfg = load_config(str(Path(ta.__file__).parent.parent / "configs" / "gpu_8b_tp2_pp2_sp.yaml"), [])
    tt = ta.import_titan()
    args = ta.model_args(tt, cfg.model)
    ta.register_spec(tt, args)
    jc = ta.job_config(tt, cfg, True, "/nonexistent")
    spec = tt.spec_mod.get_train_spec(jc.model.name)
    assert spec.build_dataloader_fn is None and spec.model_args[jc.model.flavor] is args
    with torch.device("meta"):
        model = spec.model_cls(args)
    n, flops = args.get_nparams_and_flops(model, jc.training.seq_len)
    assert (n, flops) == (ta.titan_param_count(cfg.model)[0], ta.titan_flops_per_token(cfg.model))
    assert jc.compile.enable and jc.parallelism.data_parallel_shard_degree == -1
    f8 = jc.quantize.linear.float8
    assert jc.model.converters == ["quantize.linear.float8"] and f8.filter_fqns == ["output"] and f8.recipe_name is None
    assert f8.enable_fsdp_float8_all_gather and f8.precompute_float8_dynamic_scale_for_fsdp
    assert (jc.training.local_batch_size, jc.training.global_batch_size, jc.training.seq_len) == (1, 32, 4096)


def test_whole_8b_configs_are_the_measured_layouts() -> None:
    """The user-facing whole-8B configs validate on 4 ranks and are the layouts §0 measured: DP 4 at mb 2 (H200) and
    PP 2 × DP 2 at mb 1 (80 GB cards), both with the distributed optimizer, as ``bench_e2e``'s layouts set them. The
    PP config's ``layer_split: auto`` is the [17, 15] measured against bench_e2e's even split (decision 1243)."""
    import dataclasses

    import bench_e2e as be

    from megasparse.config import load_config
    from megasparse.parallel.planner import auto_split

    root = Path(be.__file__).parent.parent
    cases = (("gpu_8b_dp4", "4gpu_8b32l_dp4", 4, 2), ("gpu_8b_pp2_dp2", "4gpu_8b32l_pp2_dp2", 2, 1))
    for name, layout, dp, mb in cases:
        cfg = load_config(str(root / "configs" / f"{name}.yaml"), [])
        assert cfg.validate(world_size=4, devices=False) == dp and cfg.train.micro_batch_size == mb
        base, world, overrides = be.LAYOUTS[layout]
        bench = load_config(str(root / base), overrides)
        if name == "gpu_8b_pp2_dp2":
            assert cfg.parallel.layer_split == "auto" and bench.parallel.layer_split is None
            assert auto_split(cfg, dp=dp).split == [17, 15]
            cfg.parallel = dataclasses.replace(cfg.parallel, layer_split=None)
        assert world == 4 and bench.parallel == cfg.parallel and bench.model == cfg.model, name
        assert cfg.logging.out_dir == f"runs/{name}"


class _Exited(Exception):
    pass


def _e2e_one_rank_fails(out: str, stuck: bool) -> dict:
    """2gpu_8b_dp2 at a tiny size on two gloo ranks; rank 1 fails the fp8 case. Rank 0 either gets out of it too
    (``stuck`` false: its row stands in, no collective) or stays inside it past the agreement's timeout."""
    import json
    import time

    import bench_e2e as be
    import torch.distributed as dist

    real, done = be.time_case, {}

    def time_case(name, cfg, a):
        if name == "fp8":
            if dist.get_rank() == 1:
                raise RuntimeError("CUDA out of memory (stand-in)")
            if stuck:
                time.sleep(3.0)  # blocked in a collective the failed rank never joins
            return done["dense"]
        done[name] = real(name, cfg, a)
        return done[name]

    def exit_(code):
        raise _Exited(code)

    be.time_case, be.AGREE_S, be.os._exit = time_case, 1.0, exit_
    tiny = ["train.device=cpu", "parallel.backend=gloo", "train.dtype=fp32", "model.num_layers=2",
            "model.hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2",
            "model.ffn_hidden_size=128", "model.seq_length=32", "model.vocab_size=250", "train.global_batch_size=2",
            "train.eval_interval=0", "data.prefix=synthetic"]  # fmt: skip
    args = ["--modes", "dense,fp8,collider", "--micro", "1", "--steps", "1", "--warmup", "1", "--gpu-warmup-s", "0"]
    try:
        rc = be.main(["2gpu_8b_dp2", *tiny, *args, "--anchors", "", "--no-repeat", "--out-dir", out])
    except _Exited as e:
        rc = f"exited {e.args[0]}"
    path = Path(out) / "e2e_2gpu_8b_dp2.json"
    return {"rc": rc, "report": json.loads(path.read_text()) if path.exists() else None}


def test_a_case_failing_on_one_rank_is_an_error_row_on_all_or_stops_the_call(tmp_path) -> None:
    """An out-of-memory on one rank: when every rank got out of the case, all record it and the next mode runs; when
    a rank is still inside it (blocked in a collective), the call stops after ``AGREE_S`` with the rows so far
    instead of waiting out the device time."""
    import json

    from distributed import run_distributed

    r0, r1 = run_distributed(_e2e_one_rank_fails, 2, str(tmp_path / "a"), False)
    rows = {c["mode"]: c for c in r0["report"]["cases"]}
    assert r0["rc"] == r1["rc"] == 1 and r0["report"]["partial"] is False
    assert rows["fp8"]["error"] == "failed on another rank" and rows["collider"]["step_ms"] > 0
    r0, r1 = run_distributed(_e2e_one_rank_fails, 2, str(tmp_path / "b"), True)
    assert r1["rc"] == "exited 1"  # rank 0 still inside the case after AGREE_S: rank 1 stops
    assert r0["rc"] == "exited 1"  # rank 0, out late, finds the next case's peer gone and stops too
    rows = {c["mode"]: c for c in r0["report"]["cases"]}
    assert r0["report"]["partial"] is True and rows["dense"]["step_ms"] > 0 and "error" in rows["fp8"]
    beside = json.loads((tmp_path / "b" / "e2e_2gpu_8b_dp2.rank1.json").read_text())  # rank 1's own rows
    assert "CUDA out of memory (stand-in)" in {c["mode"]: c for c in beside["cases"]}["fp8"]["error"]


def test_live_cuda_tensors_skips_tensors_without_memory_of_their_own() -> None:
    """The leftover-memory diagnostic runs before a case: a reachable CUDA wrapper subclass (torchtitan's DTensor,
    torchao's Float8Tensor) or a FakeTensor (torch.compile's caches) must neither stop the case (a wrapper's storage
    has no data pointer) nor be counted as memory. Both are made without a GPU."""
    import torch
    from bench_trainer import live_cuda_tensors
    from torch._subclasses.fake_tensor import FakeTensorMode

    class Wrapper(torch.Tensor):
        @staticmethod
        def __new__(cls, shape):
            return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.bfloat16, device="cuda")

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError(func)

    held = [Wrapper((1024, 1024))]
    with FakeTensorMode():
        held.append(torch.empty(1024, 1024, device="cuda"))
    assert all(t.is_cuda for t in held)
    assert live_cuda_tensors().startswith("0 reachable tensors, 0.00 GiB"), live_cuda_tensors()


def test_anchor_full_recompute_is_megatron_lms_uniform_per_layer() -> None:
    """model.recompute=full reaches megatron-core as Megatron-LM's full uniform recompute of each layer
    (bench_chunkflow's whole-8B anchor at 32K needs it); other settings leave the sdpa spec without recompute."""
    pytest.importorskip("megatron.core")
    import mcore_anchor

    from megasparse.config import load_config

    full = mcore_anchor.transformer_config(load_config(None, ["model.recompute=full"]), "sdpa")
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == ("full", "uniform", 1)
    for rc in ("none", "selective"):
        assert (
            mcore_anchor.transformer_config(load_config(None, [f"model.recompute={rc}"]), "sdpa").recompute_granularity
            is None
        )
