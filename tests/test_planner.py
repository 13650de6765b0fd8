"""megasparse plan: analytic per-stage cost against hand-computed numbers, and the split search."""

from __future__ import annotations

import itertools

import pytest

from megasparse.config import load_config
from megasparse.parallel.planner import best_split, embedding_shares, estimate, even_split, main, plans

TINY = [
    "model.num_layers=4",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.ffn_hidden_size=128",
    "model.vocab_size=250",
    "model.seq_length=16",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "train.dtype=fp32",
    "parallel.pp=4",
]
TOKENS = 16 * 2
# one block by hand: qkv 64x(3*64) + proj 64x64, fc1 64x(2*128) + fc2 128x64
BLOCK_PARAMS = 64 * 3 * 64 + 64 * 64 + 64 * 2 * 128 + 128 * 64
BLOCK_FLOPS = 6 * TOKENS * BLOCK_PARAMS + 12 * TOKENS * 16 * 64  # matmuls fwd+bwd, attention scores/values
V_PAD = 256  # 250 rounded up to make_vocab_divisible_by=64


def test_tiny_config_matches_hand_computed_flops_and_memory():
    cfg = load_config(None, TINY)
    plan = estimate(cfg, [1, 1, 1, 1], vocab_over_pp=False)
    loss = 6 * TOKENS * V_PAD * 64  # logits, dE, dC over the padded vocabulary
    assert [s.flops for s in plan.stages] == [BLOCK_FLOPS] * 3 + [BLOCK_FLOPS + loss]
    assert plan.stages[0].params == BLOCK_PARAMS + V_PAD * 64  # + input embedding
    assert plan.stages[1].params == BLOCK_PARAMS
    assert plan.stages[3].params == BLOCK_PARAMS + V_PAD * 64  # + output layer
    assert plan.stages[1].state_gib * 1024**3 == 16 * BLOCK_PARAMS
    # the distributed optimizer: fp32 parameter (this dtype) and gradient whole, master + moments split over dp
    sharded = load_config(None, TINY + ["parallel.distributed_optimizer=true", "train.global_batch_size=16"])
    assert estimate(sharded, [1, 1, 1, 1], False, dp=2).stages[1].state_gib * 1024**3 == (4 + 4 + 6) * BLOCK_PARAMS
    # 4 micro-batches per step: stage r keeps min(pp - r, 4) in flight; fp32 activations, per token: the norms'
    # inputs and outputs (4h), qkv + rotated q, k + attention output (3 x 64 for q, 3 x 64 for k/v: 4 heads, no
    # GQA), fc1's [gate | up] and the SwiGLU output (3f)
    act_layer = (4 * 64 + 3 * 64 + 3 * 64 + 3 * 128) * TOKENS * 4
    hidden = TOKENS * 64 * 4  # a middle stage's output, held per micro-batch until its backward (pipeline.InFlight)
    assert plan.stages[1].act_gib * 1024**3 == pytest.approx(3 * (act_layer + hidden))
    assert plan.stages[0].act_gib * 1024**3 == pytest.approx(4 * (act_layer + hidden))  # the embedding's: block 0's
    # the last stage's final norm keeps its input, the loss the normed hidden and, for impl=materialized, fp32
    # logits plus their compute-dtype copy
    assert plan.stages[3].act_gib * 1024**3 == pytest.approx(act_layer + 2 * hidden + TOKENS * V_PAD * 8)
    assert plan.step_flops == (4 + 4 - 1) * (BLOCK_FLOPS + loss)

    vpp = estimate(cfg, [1, 1, 1, 1], vocab_over_pp=True)
    share = 6 * TOKENS * (V_PAD // 4) * 64
    assert [s.flops for s in vpp.stages] == [BLOCK_FLOPS + share] * 4
    # both vocabulary matrices a quarter on every stage (embedding_over_pp, the default)
    assert [s.params for s in vpp.stages] == [BLOCK_PARAMS + 2 * (V_PAD // 4) * 64] * 4
    out_only = estimate(load_config(None, TINY + ["loss.embedding_over_pp=false"]), [1, 1, 1, 1], vocab_over_pp=True)
    assert [s.params for s in out_only.stages][1:] == [BLOCK_PARAMS + V_PAD // 4 * 64] * 3
    assert out_only.stages[0].params == BLOCK_PARAMS + V_PAD * 64 + V_PAD // 4 * 64


def test_tp_divides_stage_cost():
    one = estimate(load_config(None, TINY), [1, 1, 1, 1], False)
    two = estimate(load_config(None, TINY + ["parallel.tp=2"]), [1, 1, 1, 1], False)
    for a, b in zip(one.stages, two.stages):
        assert b.flops == pytest.approx(a.flops / 2)


def _brute(cfg, vocab_over_pp):
    layers, pp = cfg.model.num_layers, cfg.parallel.pp
    best = None
    for cut in itertools.combinations(range(1, layers), pp - 1):
        split = [b - a for a, b in zip((0,) + cut, cut + (layers,))]
        m = estimate(cfg, split, vocab_over_pp).max_flops
        best = m if best is None else min(best, m)
    return best


@pytest.mark.parametrize("vocab", [250, 8000, 50000, 200000])
@pytest.mark.parametrize("layers,pp", [(4, 2), (7, 3), (9, 4), (12, 4)])
@pytest.mark.parametrize("vocab_over_pp", [False, True])
def test_recommended_split_is_optimal_and_never_worse_than_even(vocab, layers, pp, vocab_over_pp):
    cfg = load_config(None, TINY + [f"model.vocab_size={vocab}", f"model.num_layers={layers}", f"parallel.pp={pp}"])
    split = best_split(cfg, vocab_over_pp)
    assert len(split) == pp and sum(split) == layers and min(split) >= 1
    got = estimate(cfg, split, vocab_over_pp).max_flops
    assert got <= estimate(cfg, even_split(layers, pp), vocab_over_pp).max_flops
    assert got == _brute(cfg, vocab_over_pp)


def test_large_vocabulary_moves_layers_off_the_last_stage_and_vocab_over_pp_balances():
    cfg = load_config(None, TINY + ["model.vocab_size=200000", "model.num_layers=12"])
    a, b, c = plans(cfg)
    assert a.split == [3, 3, 3, 3]
    assert b.split[-1] < b.split[0]
    assert b.max_flops < a.max_flops
    loss_parts = [s.flops - s.layers * BLOCK_FLOPS for s in c.stages]
    assert max(loss_parts) - min(loss_parts) <= 6 * TOKENS * 64 * 64  # within one vocabulary block
    assert c.max_flops < a.max_flops
    # the vocabulary's memory spike on the last stage is gone too
    assert c.stages[-1].state_gib < a.stages[-1].state_gib


def test_cli_prints_three_tables_and_the_recommendation(capsys):
    assert main(TINY + ["model.vocab_size=200000", "model.num_layers=12", "--dp", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("GFLOP/mb") == 3 + 3  # three headers, three summaries
    rec, emb = out.strip().splitlines()[-2:]
    assert rec.startswith("recommended: parallel.layer_split=[")
    cfg = load_config(None, TINY + ["model.vocab_size=200000", "model.num_layers=12"])
    assert str(best_split(cfg, False, dp=2)) in rec
    assert emb.startswith("with vocab_over_pp the input embedding is split [")


def test_embedding_goes_where_activations_are_fewest():
    """Water-filling: with a big activation footprint the embedding moves to the later stages and levels memory."""
    cfg = load_config(None, TINY + ["model.seq_length=4096", "model.vocab_size=20000", "train.dtype=bf16"])
    shares = embedding_shares(cfg, [1, 1, 1, 1], dp=1)
    assert sum(shares) == pytest.approx(1.0) and shares == sorted(shares) and shares[0] < shares[-1]
    plan = estimate(cfg, [1, 1, 1, 1], True, emb_shares=shares)
    mem = [s.mem_gib for s, share in zip(plan.stages, shares) if share > 0]  # the stages that took embedding rows
    assert max(mem) - min(mem) < 1e-6 * max(mem)
    even = estimate(cfg, [1, 1, 1, 1], True, emb_shares=[0.25] * 4)
    assert max(s.mem_gib for s in plan.stages) < max(s.mem_gib for s in even.stages)


def test_cli_needs_a_vocabulary(capsys):
    assert main(["model.num_layers=4", "parallel.pp=2"]) == 2
    err = capsys.readouterr().err
    assert "model.vocab_size" in err and len(err.strip().splitlines()) == 1


def test_recompute_fp8_and_2to4_change_the_memory_estimate():
    """Selective recompute drops the rotated q/k and the SwiGLU output; full keeps each block's input plus the one
    block being rebuilt; fp8 adds two one-byte copies of every matmul weight, 2:4 under fp8 one mask byte per FFN
    weight (the counts the whole 8B's first stage matched within 1 GiB on H200s, planner docstrings)."""

    def stage1(extra: list[str]):
        return estimate(load_config(None, TINY + extra), [1, 1, 1, 1], vocab_over_pp=False).stages[1]

    base = stage1([])
    per_token = {"none": 4 * 64 + 3 * 64 + 3 * 64 + 3 * 128, "selective": 4 * 64 + 2 * 64 + 2 * 64 + 2 * 128}
    sel = stage1(["model.recompute=selective"])
    assert sel.act_gib * 1024**3 == pytest.approx(3 * (per_token["selective"] + 64) * TOKENS * 4)  # + the output
    full = stage1(["model.recompute=full"])
    assert full.act_gib * 1024**3 == pytest.approx((3 * (64 + 64) + per_token["none"]) * TOKENS * 4)
    assert full.act_gib < sel.act_gib < base.act_gib
    fp8 = stage1(["train.fp8=tensorwise"])
    assert (fp8.state_gib - base.state_gib) * 1024**3 == pytest.approx(2 * BLOCK_PARAMS)
    # qkv's, fc1's and fc2's inputs (2h + f per token) kept as one e4m3 byte, not a 4-byte fp32 element (1245)
    saved = 3 * TOKENS * (2 * 64 + 128) * (4 - 1)
    assert (base.act_gib - fp8.act_gib) * 1024**3 == pytest.approx(saved)
    both = stage1(["train.fp8=tensorwise", "sparsity.enabled=true"])
    assert (both.state_gib - fp8.state_gib) * 1024**3 == pytest.approx(3 * 64 * 128)


def test_compute_copies_of_fp32_masters_count_without_the_distributed_optimizer():
    """bf16 compute with fp32 masters keeps a bf16 copy of every dense linear and of the output weight
    (``ComputeCopies``); the distributed optimizer's parameters are those copies, and fp8's GEMMs keep e4m3 ones."""

    def state(extra: list[str], stage: int) -> float:
        cfg = load_config(None, TINY + ["train.dtype=bf16", *extra])
        return estimate(cfg, [1, 1, 1, 1], vocab_over_pp=False).stages[stage].state_gib * 1024**3

    assert state([], 1) == 16 * BLOCK_PARAMS + 2 * BLOCK_PARAMS
    assert state([], 3) == 16 * (BLOCK_PARAMS + V_PAD * 64) + 2 * (BLOCK_PARAMS + V_PAD * 64)  # + the output's
    assert state(["train.fp8=tensorwise"], 1) == 16 * BLOCK_PARAMS + 2 * BLOCK_PARAMS  # e4m3 W and Wᵀ, no bf16 copy
    assert state(["sparsity.enabled=true"], 1) == pytest.approx(
        18 * BLOCK_PARAMS - 2 * 3 * 64 * 128 + 3 * 64 * 128 * 3.25  # the FFN keeps mask + packed operands instead
    )
