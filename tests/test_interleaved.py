"""Interleaved 1F1B (``parallel.virtual_stages``): the plan, its config checks, and real gloo runs that train like
one process, keep the compact backward compact over the ring, and resume from their own checkpoints."""

from __future__ import annotations

import functools

import pytest
from distributed import run_distributed
from test_parallel_equivalence import BASE, STEPS, rel
from test_resume import BASE as RESUME_BASE
from test_resume import losses as resume_losses

from megasparse.config import ConfigError, load_config
from megasparse.parallel import interleaved

# ------------------------------------------------------------------------------------------- the plan
LAYOUTS = [(P, v, P * g) for P in (2, 3, 4) for v in (1, 2, 3) for g in (1, 2, 3)] + [(8, 2, 16), (8, 4, 8)]


@pytest.mark.parametrize("two_phase", [False, True])
def test_plan_pairs_every_transfer_and_never_deadlocks(two_phase):
    """Every rank's plan against the others: each channel's sends meet receives of the same (chunk, micro-batch)
    in the same order (with pp=2 activations and gradients share one channel), inputs arrive before they are
    needed, nobody waits forever; with rows sent in a second batch too (unbalanced SP shards)."""
    for P, v, M in LAYOUTS:
        interleaved.simulate(P, v, M, two_phase=two_phase)


@pytest.mark.parametrize("t_f,t_b", [(1.0, 2.0), (1.0, 1.0), (1.0, 3.0)])
def test_bubble_shrinks_by_the_chunk_count(t_f, t_b):
    """Equal stages, free transfers: the step is M·(f+b) of work plus (P−1)·(f+b)/v idle, i.e. the bubble is
    (P−1)/(v·M+P−1) of the step: v=1 is plain 1F1B's (P−1)/(M+P−1)."""
    for P, v, M in LAYOUTS:
        span, busy = interleaved.simulate(P, v, M, t_f / v, t_b / v)
        assert busy == pytest.approx([M * (t_f + t_b)] * P)
        assert 1 - M * (t_f + t_b) / span == pytest.approx(interleaved.bubble_fraction(P, v, M))


def test_plan_runs_each_chunk_once_per_micro_batch_in_megatron_order():
    P, v, M = 4, 2, 8
    for r in range(P):
        steps = interleaved.plan(P, r, v, M)
        comp = [s for s in steps if isinstance(s, interleaved.Compute)]
        fwd = [(s.chunk, s.mb) for s in comp if s.kind == "F"]
        bwd = [(s.chunk, s.mb) for s in comp if s.kind == "B"]
        assert sorted(fwd) == sorted(bwd) == [(c, i) for c in range(v) for i in range(M)]
        # groups of P micro-batches per chunk, chunks ascending forward and descending backward
        assert fwd[:8] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]
        assert bwd[:4] == [(1, 0), (1, 1), (1, 2), (1, 3)]
        warm = interleaved.warmup_forwards(P, r, v, M)
        assert warm == (P - r - 1) * 2 + (v - 1) * P
        assert [s.kind for s in comp[: warm + 1]] == ["F"] * (warm + 1) and comp[warm + 1].kind == "B"
    with pytest.raises(ValueError, match="multiple of pp"):
        interleaved.plan(4, 0, 2, 6)


# ---------------------------------------------------------------------------------------- config checks
def check(overrides: list[str], world: int, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as e:
        load_config(None, BASE + overrides).validate(world)
    assert "\n" not in str(e.value)


def test_config_rejects_what_interleaving_cannot_run():
    check(["parallel.virtual_stages=2"], 1, "needs parallel.pp > 1")
    check(["parallel.virtual_stages=0"], 1, "must be >= 1")
    check(["parallel.pp=2", "parallel.virtual_stages=3"], 2, "not divisible by parallel.pp x parallel.virtual")
    check(["parallel.pp=2", "parallel.virtual_stages=2", "parallel.layer_split=[1,3]"], 2, "must have 4 entries")
    check(["parallel.pp=2", "parallel.virtual_stages=2", "train.global_batch_size=6"], 2, "multiple of parallel.pp")
    check(["parallel.pp=2", "parallel.virtual_stages=2", "loss.vocab_over_pp=true"], 2, "lock-step")
    cfg = load_config(None, BASE + ["parallel.pp=2", "parallel.virtual_stages=2", "parallel.layer_split=[2,1,0,1]"])
    with pytest.raises(ConfigError, match="every stage needs a layer"):
        cfg.validate(2)
    ok = load_config(None, BASE + ["model.num_layers=5", "parallel.pp=2", "parallel.virtual_stages=2"])
    with pytest.raises(ConfigError, match="layer_split per virtual stage"):
        ok.validate(2)
    split = ["model.num_layers=5", "parallel.pp=2", "parallel.virtual_stages=2", "parallel.layer_split=[2,1,1,1]"]
    ok = load_config(None, BASE + split)
    assert ok.validate(2) == 1 and ok.parallel.stage_layers(5) == [2, 1, 1, 1]


# ------------------------------------------------------------------------------------- real gloo runs
V2 = ["parallel.pp=2", "parallel.virtual_stages=2"]
COLLIDER = ["filter.mode=collider", "filter.keep_ratio=0.5", "filter.scorer=random"]


def train_and_collect(overrides: list[str], steps: int) -> dict:
    """Per-step losses, final full weights, the validation loss, and which global layers this rank holds."""
    from megasparse.config import load_config
    from megasparse.ops.compact import densify_count
    from megasparse.parallel.consolidate import full_state_dict
    from megasparse.train import Trainer

    cfg = load_config(None, BASE + overrides + ["train.eval_batches=1"])
    tr = Trainer(cfg)
    losses = [tr.train_step().loss for _ in range(steps)]
    names = [tr.model.global_name(n) for n, _ in tr.model.named_parameters()]
    return {
        "losses": losses,
        "weights": full_state_dict(tr.model),
        "val": tr.evaluate(),
        "layers": sorted({int(n.split(".")[1]) for n in names if n.startswith("layers.")}),
        "densified": densify_count(),
    }


@functools.cache
def reference(world: int, overrides: tuple[str, ...]) -> dict:
    return run_distributed(train_and_collect, world, list(overrides), STEPS)[0]


def assert_same_training(res: list[dict], ref: dict) -> None:
    for r in res:
        for a, b in zip(r["losses"], ref["losses"], strict=True):
            assert abs(a - b) / abs(b) < 1e-5, (r["losses"], ref["losses"])
        assert abs(r["val"] - ref["val"]) / abs(ref["val"]) < 1e-5
        assert r["densified"] == 0
    w = res[0]["weights"]
    assert set(w) == set(ref["weights"])
    worst = max(rel(w[k], ref["weights"][k]) for k in w)
    assert worst < 1e-5, worst
    assert ref["losses"][0] != ref["losses"][-1]  # it trained


CASES = {
    # name: (world, interleaved overrides, reference world, reference overrides)
    "pp2_v2_dense": (2, V2, 1, []),
    "pp2_v2_collider": (2, V2 + COLLIDER, 1, COLLIDER),
    # micro-batches = pp: every forward is warm-up, no steady state
    "pp2_v2_all_warmup": (2, V2 + ["train.global_batch_size=4"], 1, ["train.global_batch_size=4"]),
    # uneven virtual stages from parallel.layer_split
    "pp2_v2_layer_split": (
        2,
        V2 + ["model.num_layers=5", "parallel.layer_split=[2,1,1,1]"] + COLLIDER,
        1,
        ["model.num_layers=5"] + COLLIDER,
    ),
    # pp=4: the ring's channels are distinct, rank 0 receives from rank 3
    "pp4_v2_dense": (
        4,
        ["parallel.pp=4", "parallel.virtual_stages=2", "model.num_layers=8"],
        1,
        ["model.num_layers=8"],
    ),
    "tp2_sp_pp2_v2_dense": (4, V2 + ["parallel.tp=2", "parallel.sequence_parallel=true"], 1, []),
    # microbatch selection under SP: shards unbalanced, rows follow their indices in a second batch
    "tp2_sp_pp2_v2_collider_unbalanced": (
        4,
        V2 + ["parallel.tp=2", "parallel.sequence_parallel=true", "filter.granularity=microbatch"] + COLLIDER,
        1,
        ["filter.granularity=microbatch"] + COLLIDER,
    ),
    # balanced selection under SP (the default): static row counts, one batch; the selection depends on the SP
    # size, so the reference is the same TP=2+SP layout without a pipeline
    "tp2_sp_pp2_v2_collider_balanced": (
        4,
        V2 + ["parallel.tp=2", "parallel.sequence_parallel=true"] + COLLIDER,
        2,
        ["parallel.tp=2", "parallel.sequence_parallel=true"] + COLLIDER,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_interleaved_trains_like_the_reference(name):
    world, ov, ref_world, ref_ov = CASES[name]
    res = run_distributed(train_and_collect, world, ov, STEPS)
    assert_same_training(res, reference(ref_world, tuple(ref_ov)))
    if name == "pp2_v2_dense":  # chunk c of rank r holds virtual stage c·pp + r
        assert [r["layers"] for r in res] == [[0, 2], [1, 3]]


def pp_traffic(overrides: list[str], steps: int) -> dict:
    """This rank's pipeline sends per phase, with token filtering and then dense on the same groups."""
    from megasparse.config import load_config
    from megasparse.ops.compact import densify_count
    from megasparse.profile.collect import record_steps
    from megasparse.train import Trainer

    out = {}
    for label, extra in (("collider", COLLIDER), ("dense", [])):
        tr = Trainer(load_config(None, BASE + overrides + extra), init_groups=label == "collider")
        recs = [r for r in record_steps(tr, steps) if (r["kind"], r["group"]) == ("send", "pp")]
        for phase in ("forward", "backward"):
            mine = [r for r in recs if r["phase"] == phase]
            out[f"{label}.{phase}"] = (len(mine), sum(r["bytes"] for r in mine))
        if tr.filter is not None:
            out["kept_rows"] = tr.filter.kept_rows
    out["densified"] = densify_count()
    return out


@pytest.mark.slow
def test_compact_backward_stays_compact_over_the_ring():
    """Backward P2P bytes with collider = keep_ratio of dense (plus 8 bytes of index per kept row); the forward's
    are unchanged; every virtual-stage boundary but the last sends once per micro-batch each way."""
    res = run_distributed(pp_traffic, 2, V2, 2)
    cfg = load_config(None, BASE + V2)
    m, b = cfg.model, cfg.train.micro_batch_size
    n, h, M = m.seq_length * b, m.hidden_size, cfg.num_microbatches(1)
    sends = {"forward": 0, "backward": 0}
    for rank in res:
        k = rank["kept_rows"]
        assert rank["densified"] == 0
        assert rank["collider.forward"] == rank["dense.forward"]
        fwd_calls, bwd_calls = rank["dense.forward"][0], rank["dense.backward"][0]
        assert rank["collider.backward"] == (2 * bwd_calls, bwd_calls * k * (4 * h + 8))  # indices + rows
        assert rank["dense.backward"][1] == bwd_calls * n * h * 4
        ratio = rank["collider.backward"][1] / rank["dense.backward"][1]
        assert ratio == pytest.approx(0.5 * (1 + 2 / h))  # keep_ratio 0.5, int64 index per fp32 row of h
        sends["forward"] += fwd_calls
        sends["backward"] += bwd_calls
    boundaries = 2 * 2 - 1  # pp · v virtual stages
    assert sends == {"forward": 2 * M * boundaries, "backward": 2 * M * boundaries}


@pytest.mark.slow
def test_resume_with_virtual_stages(tmp_path):
    """Stopped at step 2 and resumed from its sharded checkpoint, a PP=2 × v=2 run continues exactly."""
    assert "model.num_layers=2" in RESUME_BASE
    out = [f"logging.out_dir={tmp_path}", *V2, "model.num_layers=4", "train.steps=4"]
    full = run_distributed(resume_losses, 2, out, None, None)[0]
    first = run_distributed(resume_losses, 2, out, 2, None)[0]
    assert (tmp_path / "checkpoints" / "step-2" / ".metadata").exists()
    rest = run_distributed(resume_losses, 2, out, None, str(tmp_path))[0]
    assert first == full[:2]
    for a, b in zip(rest, full[2:], strict=True):
        assert abs(a - b) <= 1e-6 * abs(b), (rest, full)


def test_replay_times_transfers_and_names_a_deadlock():
    """The simulators' shared loop: a receive waits for its send's clock; two ranks that both receive first hang."""
    from megasparse.parallel.rendezvous import replay

    streams = [[("F", 0), [("send", (0, 1), "a")]], [[("recv", (0, 1), "a")], ("F", 0)]]
    assert replay(streams, lambda r, op, have: 1.0 + r, "toy") == ([1.0, 3.0], [1.0, 2.0])
    with pytest.raises(AssertionError, match=r"deadlock: ranks \[0, 1\] wait \(toy\)"):
        replay([[[("recv", (1, 0), "x")]], [[("recv", (0, 1), "y")]]], lambda r, op, have: 1.0, "toy")
