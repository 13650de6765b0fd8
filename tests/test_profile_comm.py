"""profile-comm: report arithmetic on synthetic records, then real gloo runs checked against the config."""

from __future__ import annotations

import json
import random

import pytest
from distributed import run_distributed
from test_parallel_equivalence import BASE

from megasparse.profile import report

# --------------------------------------------------------------------------- synthetic records
PHASE_KINDS = {
    "forward": [("all_reduce", "tp"), ("all_gather", "tp"), ("send", "pp")],
    "backward": [("reduce_scatter", "tp"), ("send", "pp")],
    "optim": [("all_reduce", "dp"), ("all_reduce", "mp")],
    "metrics": [("all_reduce", "world")],
}


def synthetic(rng: random.Random, n: int, steps: int = 3, ranks: int = 2) -> list[dict]:
    out = []
    for _ in range(n):
        phase = rng.choice(["metrics", "backward", "optim", "forward"])
        kind, group = rng.choice(PHASE_KINDS[phase])
        numel = rng.randint(1, 5000)
        size = rng.choice([2, 4, 8])
        out.append(
            dict(
                phase=phase,
                kind=kind,
                group=group,
                region=f"r{rng.randint(0, 3)}",
                numel=numel,
                dtype={2: "bfloat16", 4: "float32", 8: "float64"}[size],
                bytes=numel * size,
                duration_ms=None,
                step=rng.randrange(steps),
                rank=rng.randrange(ranks),
            )
        )
    return out


def scaled_backward(records: list[dict], num: int, den: int) -> list[dict]:
    """The same traffic with every backward transfer shrunk to num/den of its rows."""
    out = []
    for r in records:
        r = dict(r)
        if r["phase"] == "backward":
            per = r["bytes"] // r["numel"]
            assert r["numel"] % den == 0
            r["numel"] = r["numel"] * num // den
            r["bytes"] = r["numel"] * per
        out.append(r)
    return out


def test_group_records_sums_match_a_direct_filter():
    rng = random.Random(7)
    recs = synthetic(rng, 400)
    groups = report.group_records(recs)
    for (phase, kind, group), t in groups.items():
        mine = [r for r in recs if (r["phase"], r["kind"], r["group"]) == (phase, kind, group)]
        assert t.calls == len(mine)
        assert t.numel == sum(r["numel"] for r in mine)
        assert t.bytes == sum(r["bytes"] for r in mine)
        assert t.ms is None
    assert sum(t.calls for t in groups.values()) == len(recs)
    phases = [k[0] for k in groups]
    assert phases == sorted(phases, key=report.PHASES.index), phases
    by_region = report.group_records(recs, keys=("region",))
    assert sum(t.bytes for t in by_region.values()) == sum(r["bytes"] for r in recs)


def test_class_totals_split_token_traffic_by_phase():
    recs = synthetic(random.Random(11), 300)
    cls = report.class_totals(recs)
    for phase in ("forward", "backward"):
        assert cls[f"token.{phase}"].bytes == sum(r["bytes"] for r in recs if r["phase"] == phase)
    assert cls["token"].bytes == cls["token.forward"].bytes + cls["token.backward"].bytes
    assert cls["param"].bytes == sum(r["bytes"] for r in recs if r["phase"] == "optim")
    assert cls["metrics"].calls == sum(r["phase"] == "metrics" for r in recs)
    odd = dict(recs[0], phase="checkpoint")
    assert report.traffic_class(odd) == "other"
    assert report.class_totals([odd])["other"].calls == 1


def test_counted_drops_warmup_steps():
    recs = synthetic(random.Random(3), 200, steps=4)
    kept = report.counted(recs, warmup_steps=1)
    assert len(kept) == sum(r["step"] >= 1 for r in recs)
    assert all(r["step"] >= 1 for r in kept)
    assert report.counted(recs, 0) == recs


def test_ratios_of_a_shrunk_backward():
    rng = random.Random(5)
    dense = [r for r in synthetic(rng, 300) if r["numel"] % 5 == 0] or synthetic(rng, 1)
    filt = scaled_backward(dense, 3, 5)
    ratios = report.byte_ratios(report.group_records(filt), report.group_records(dense))
    for (phase, _, _), r in ratios.items():
        assert r == pytest.approx(0.6 if phase == "backward" else 1.0)
    dcls, fcls = report.class_totals(dense), report.class_totals(filt)
    assert report.ratio(fcls["token.backward"].bytes, dcls["token.backward"].bytes) == pytest.approx(0.6)
    assert fcls["param"].bytes == dcls["param"].bytes


def test_ratio_edge_cases():
    assert report.ratio(0, 0) == 1.0
    assert report.ratio(5, 0) is None
    a = {("backward", "send", "pp"): report.Totals(1, 10, 40)}
    b = {("forward", "send", "pp"): report.Totals(1, 10, 40)}
    r = report.byte_ratios(a, b)
    assert r[("forward", "send", "pp")] == 0.0  # dense moved it, filtered did not
    assert r[("backward", "send", "pp")] is None  # only the filtered run moved it


def test_tables_name_every_group_and_total():
    recs = synthetic(random.Random(13), 120)
    recs[0]["duration_ms"] = 1.5
    groups = report.group_records(recs)
    text = report.group_table(groups)
    lines = text.splitlines()
    assert lines[0].startswith("| phase | kind | group | calls | elements | MB | ms |")
    assert len(lines) == 2 + len(groups) + 1
    total_bytes = sum(r["bytes"] for r in recs)
    assert lines[-1].split("|")[6].strip() == f"{total_bytes / 1e6:.4g}"
    for (phase, kind, group), t in groups.items():
        assert any(line.startswith(f"| {phase} | {kind} | {group} | {t.calls} | {t.numel} |") for line in lines)
    cmp = report.compare_table(report.group_records(scaled_backward(recs, 1, 1)), groups, label="collider")
    assert "collider/dense" in cmp.splitlines()[0]
    assert cmp.count("| 1.000 |") == len(groups)


def test_document_roundtrip_summary_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from megasparse.profile.cli import write_outputs

    rng = random.Random(17)
    dense = [r for r in synthetic(rng, 200) if r["numel"] % 2 == 0]
    doc = {
        "meta": {
            "primary": "collider",
            "anchor": "dense",
            "steps": 3,
            "warmup_steps_excluded": 1,
            "filter_mode": "collider",
            "keep_ratio": 0.5,
            "world_size": 2,
            "layout": {"tp": 2, "pp": 1, "dp": 1, "sequence_parallel": False},
            "device": "cpu",
        },
        "runs": {"collider": {"records": scaled_backward(dense, 1, 2)}, "dense": {"records": dense}},
    }
    written = write_outputs(doc, tmp_path)
    assert [p.name for p in written] == ["comm.json", "comm.png"]
    assert (tmp_path / "comm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    back = report.load(tmp_path / "comm.json")
    assert back == json.loads(json.dumps(doc))
    assert len(report.run_records(back, "dense")) == sum(r["step"] >= 1 for r in dense)
    text = report.summary(back)
    assert "collider vs dense" in text and "warm-up" in text
    bwd = [line for line in text.splitlines() if line.startswith("| token-sized, backward |")]
    assert len(bwd) == 1 and bwd[0].rstrip(" |").endswith("0.500")
    with pytest.raises(ValueError):
        (tmp_path / "bad.json").write_text("{}")
        report.load(tmp_path / "bad.json")


def test_cli_arguments_and_reference_fallback():
    from megasparse.config import load_config
    from megasparse.profile.cli import parse_args
    from megasparse.profile.collect import missing_reference

    a = parse_args(["filter.mode=collider", "parallel.tp=2", "--steps", "2", "--no-compare-dense"])
    assert a.config is None and a.overrides == ["filter.mode=collider", "parallel.tp=2"]
    assert a.steps == 2 and a.compare_dense is False and a.out_dir is None
    assert parse_args(["c.yaml"]).compare_dense is None  # decided from filter.mode
    with pytest.raises(SystemExit):
        parse_args(["c.yaml", "--steps", "0"])
    base = ["filter.mode=collider", "filter.scorer=excess"]
    assert "data.ref_losses" in missing_reference(load_config(None, base + ["filter.reference=sidecar"]))
    assert "filter.ngram_path" in missing_reference(load_config(None, base + ["filter.reference=ngram"]))
    assert missing_reference(load_config(None, base + ["filter.reference=ngram", "filter.ngram_path=x.json"])) is None
    assert missing_reference(load_config(None, ["filter.mode=collider", "filter.scorer=loss"])) is None
    assert missing_reference(load_config(None, ["filter.mode=off"])) is None


# ------------------------------------------------------------------------------ real gloo runs
# the parallel-equivalence tests' tiny synthetic model; each test below overrides the layout and sizes
TINY = BASE


def run_cli(args: list[str], out_dir: str) -> dict | None:
    """``megasparse profile-comm`` on this rank; rank 0 returns the written comm.json."""
    import torch.distributed as dist

    from megasparse.profile.cli import main

    rank = int(__import__("os").environ["RANK"])
    assert main(args + ["--out-dir", out_dir]) == 0
    assert not dist.is_initialized()  # the CLI tears its groups down
    return report.load(f"{out_dir}/comm.json") if rank == 0 else None


def local_param_count(cfg, tp: int) -> int:
    """Parameters one TP rank holds in a pp=1 model, from the config alone."""
    m = cfg.model
    h, d, f = m.hidden_size, m.head_dim, m.ffn_size
    vp = cfg.padded_vocab(m.vocab_size)
    qkv = (m.num_attention_heads + 2 * m.kv_heads) * d * h // tp
    proj = h * m.num_attention_heads * d // tp
    mlp = 2 * f * h // tp + h * f // tp
    per_layer = qkv + proj + mlp + 2 * h  # + two replicated norms
    return m.num_layers * per_layer + 2 * (vp // tp) * h + h  # embedding, output layer, final norm


@pytest.mark.slow
def test_dense_tp2_dp2_volumes_follow_the_config(tmp_path):
    from megasparse.config import load_config

    over = TINY + ["model.num_layers=2", "model.seq_length=16", "parallel.tp=2"]
    doc = run_distributed(run_cli, 4, [*over, "--steps", "2"], str(tmp_path))[0]
    cfg = load_config(None, over)
    m, tp, dp = cfg.model, 2, 2
    sbh = m.seq_length * cfg.train.micro_batch_size * m.hidden_size
    sb = m.seq_length * cfg.train.micro_batch_size
    meta = doc["meta"]
    assert meta["layout"]["tp"] == tp and meta["layout"]["dp"] == dp and meta["world_size"] == 4
    assert meta["anchor"] is None and meta["warmup_steps_excluded"] == 1
    counted_steps = meta["steps"] - meta["warmup_steps_excluded"]
    calls = cfg.num_microbatches(dp) * counted_steps  # per region, per rank
    recs = report.run_records(doc, "dense")
    assert {r["rank"] for r in recs} == {0, 1, 2, 3}
    hidden_fwd = ["embedding.out"] + [
        f"layers.{i}.{n}.out" for i in range(m.num_layers) for n in ("attn.proj", "mlp.fc2")
    ]
    hidden_bwd = ["loss.dgrad"] + [
        f"layers.{i}.{n}.dgrad" for i in range(m.num_layers) for n in ("attn.qkv", "mlp.fc1")
    ]
    expect_params = local_param_count(cfg, tp)
    for rank in range(4):
        mine = [r for r in recs if r["rank"] == rank]
        tp_fwd = [r for r in mine if r["phase"] == "forward" and r["group"] == "tp"]
        tp_bwd = [r for r in mine if r["phase"] == "backward" and r["group"] == "tp"]
        for phase_recs, regions in ((tp_fwd, hidden_fwd), (tp_bwd, hidden_bwd)):
            for region in regions:
                hits = [r for r in phase_recs if r["region"] == region]
                assert len(hits) == calls, (rank, region, len(hits))
                assert all(r["kind"] == "all_reduce" and r["numel"] == sbh for r in hits), (rank, region)
        # what is not hidden-sized in forward is the loss's per-token statistics: one all-gather of (lse, target)
        stats = [r for r in tp_fwd if r["region"] not in hidden_fwd]
        assert {r["region"] for r in stats} == {"loss.stats"} and len(stats) == calls
        assert all(r["kind"] == "all_gather" and r["numel"] == 2 * sb for r in stats)
        assert {r["region"] for r in tp_bwd} == set(hidden_bwd)
        fwd_bytes = sum(r["bytes"] for r in tp_fwd) - sum(r["bytes"] for r in stats)
        assert fwd_bytes == sum(r["bytes"] for r in tp_bwd) > 0
        optim = [r for r in mine if r["phase"] == "optim"]
        dp_red = [r for r in optim if r["region"] == "grads.dp"]
        assert len(dp_red) == counted_steps
        assert all(r["group"] == "dp" and r["numel"] == expect_params and r["dtype"] == "float32" for r in dp_red)
        norm = [r for r in optim if r["region"] == "grads.norm"]
        assert len(norm) == counted_steps and all(r["numel"] == 1 and r["dtype"] == "float32" for r in norm)
        assert len(optim) == 2 * counted_steps
    cls = report.class_totals(recs)
    # per rank and step: the fp32 DP gradient all-reduce plus the one-element fp32 grad-norm all-reduce
    assert cls["param"].bytes == 4 * counted_steps * (4 * expect_params + 4)
    assert cls["token.forward"].bytes > cls["token.backward"].bytes > 0


@pytest.mark.slow
def test_collider_tp2_sp_pp2_backward_shrinks_to_keep_ratio(tmp_path):
    """The issue's acceptance test: forward and parameter traffic unchanged, backward at keep_ratio."""
    keep = 0.6
    # per-shard selection keeps exactly ceil(0.6 · s·b/tp) rows on every SP shard: no padding to the largest
    over = TINY + [
        "model.num_layers=4",
        "model.seq_length=40",
        "model.hidden_size=128",
        "parallel.tp=2",
        "parallel.pp=2",
        "parallel.sequence_parallel=true",
        "filter.mode=collider",
        f"filter.keep_ratio={keep}",
        "filter.granularity=shard",
        "filter.scorer=loss",
    ]
    doc = run_distributed(run_cli, 4, [*over, "--steps", "2"], str(tmp_path))[0]
    assert (tmp_path / "comm.png").exists()
    meta = doc["meta"]
    assert meta["primary"] == "collider" and meta["anchor"] == "dense" and meta["keep_ratio"] == keep
    filt, dense = report.run_records(doc, "collider"), report.run_records(doc, "dense")
    fcls, dcls = report.class_totals(filt), report.class_totals(dense)
    # forward: same transfers, same sizes
    fwd = report.group_records([r for r in filt if r["phase"] == "forward"], ("kind", "group", "region", "numel"))
    dfwd = report.group_records([r for r in dense if r["phase"] == "forward"], ("kind", "group", "region", "numel"))
    assert {k: t.bytes for k, t in fwd.items()} == {k: t.bytes for k, t in dfwd.items()}
    assert any(k[:2] == ("send", "pp") for k in fwd)
    # backward token-sized traffic (TP/SP collectives + PP sends with their indices, padding included)
    r = report.ratio(fcls["token.backward"].bytes, dcls["token.backward"].bytes)
    assert abs(r - keep) <= 0.03, r
    for kind, group in (("all_gather", "tp"), ("reduce_scatter", "tp"), ("send", "pp")):
        part = [
            sum(x["bytes"] for x in recs if (x["phase"], x["kind"], x["group"]) == ("backward", kind, group))
            for recs in (filt, dense)
        ]
        assert part[1] > 0 and part[0] < 0.7 * part[1], (kind, group, part)
    # parameter-sized traffic untouched
    pkeys = ("kind", "group", "region", "numel", "rank")
    assert {k: t.bytes for k, t in report.group_records([x for x in filt if x["phase"] == "optim"], pkeys).items()} == {
        k: t.bytes for k, t in report.group_records([x for x in dense if x["phase"] == "optim"], pkeys).items()
    }
    assert fcls["param"].bytes > 0
