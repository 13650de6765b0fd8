"""The packed last chunks' FlexAttention variants predicted from the plan (``chunkflow/tailwarm.py``, decision 1241).

On CPU flex runs eagerly, so nothing compiles; what is checked is the prediction the GPU's warm-up compiles from:
the variant keys ``tail_flex.chosen`` records while the steps run equal those ``tailwarm`` predicts for the same
steps (a tiny ChunkFlow run on the synthetic long-tail stream, tails packed, three prefix lengths over five steps),
and the warm-up's own synthetic chunk asks for exactly the predicted key of its prefix. As the steps run, the keys
are padded to the longest sequence's chunks (decision 1248): one variant serves all three prefixes. Unpadded (a
source that cannot say its longest sequence) each prefix is a variant, and a prediction over fewer steps misses
the variant only the last step needs. The GPU test checks that after the warm-up the steps add no
compiled entry to the tail wrappers' caches.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from tiny import TRAINING, tiny

from megasparse.config import load_config
from megasparse.ops import doc_flex, tail_flex

if not doc_flex.available():
    pytest.skip("this torch has no FlexAttention", allow_module_level=True)

STEPS = 5
PREFIXES = [16, 32, 48]  # of steps 0-4 at seed 1234 (step 4 alone brings 32); chunks of 16, sequences up to 96


def _config(extra=()):
    base = tiny(**TRAINING, train__global_batch_size=24, train__micro_batch_size=1, model__num_layers=2)
    return load_config(None, base + [
        "chunkflow.enabled=true", "chunkflow.max_sequence_length=96", "chunkflow.max_chunks_in_memory=1",
        f"train.steps={STEPS}", "parallel.grad_bucket_numel=20000", *extra,
    ])  # fmt: skip


def _trainer(extra=()):
    """The tiny trainer with short sequences packed and tails packed on flex (the synthetic stream has no document
    ids of its own, so the step is told its end-of-document id, as ``tests/test_chunkflow.py``'s pipeline does)."""
    from megasparse.train import Trainer

    tr = Trainer(_config(extra))
    cf = tr.chunkflow
    cf.eod, cf.pack, cf.pack_tails, cf.doc_kernel = 0, True, True, "flex"
    return tr


def _run(padded: bool) -> dict:
    """A tiny ChunkFlow run of ``STEPS`` steps; the keys its packed last chunks asked for and the predictions.
    ``padded``: the keys padded to the run's width (96: six chunks of 16), else one variant per prefix."""
    from megasparse.chunkflow import tailwarm
    from megasparse.chunkflow.plan import plan_step

    tail_flex.REQUESTED.clear()
    tr = _trainer()
    cf = tr.chunkflow
    if not padded:
        cf.tail_width = None
    assert cf.tail_warmup is None and cf.steps == STEPS
    per_step, rec = [], None
    for s in range(STEPS):
        plan = plan_step([len(t) for _, t in cf.source.step_sequences(s, cf.per_step)], cf.c, 1, True, 96, True)
        per_step.append(sorted({g.chunks[-1].offset for g in plan.groups if len(g.chunks[-1].pieces) > 1 and
                                len(g.chunks) > 1}))  # fmt: skip
        tr.train_step()
        rec = rec if s else cf.tail_warmup  # the first step's plan ran the warm-up (over steps 0-4), once
        assert cf.tail_warmup is rec
    asked = set(tail_flex.REQUESTED)
    tail_flex.REQUESTED.clear()
    attn, dtype = tailwarm._attention(cf)
    tailwarm._one(cf, attn, dtype, 32)  # the warm-up's synthetic chunk, eager here
    out = {
        "rec": rec,
        "per_step": per_step,
        "asked": asked,
        "predicted": set(tailwarm.predicted_keys(cf, rec["tail_prefixes"])),
        "short": set(tailwarm.predicted_keys(cf, tailwarm.tail_prefixes(cf, range(STEPS - 1)))),
        "one": set(tail_flex.REQUESTED),
        "at32": set(tailwarm.predicted_keys(cf, [32])),
        "others": {},
    }
    # dynamo's limit at 4 with P = 16 compiled already (an earlier case of the process): room for one more P (two
    # keys each on this route), the smallest new one; P = 48 is left to the bias kernels and said so
    limit, shapes = tail_flex._limit, tail_flex._SHAPES
    tail_flex._limit, tail_flex._SHAPES = (lambda: 4), set(tailwarm.predicted_keys(cf, [16]))
    try:
        out["limited"] = tailwarm.warm_tails(cf, range(STEPS), log=lambda s: None)
    finally:
        tail_flex._limit, tail_flex._SHAPES = limit, shapes
    lines: list[str] = []  # the GPU's progress, its synthetic chunks run eagerly here
    warmed = set(tail_flex.WARMED)
    out["ran"] = tailwarm.warm_tails(cf, range(STEPS), log=lines.append, run=True), lines
    tail_flex.WARMED.intersection_update(warmed)  # (read on CUDA only: no CPU keys left behind)
    for kernel in ("bias", "auto"):  # the bias kernels (auto: at fp32 / on CPU): nothing to compile
        cf.doc_kernel = kernel
        out["others"][kernel] = tailwarm.predicted_keys(cf, PREFIXES)
    return out


def test_one_padded_variant_serves_every_prefix() -> None:
    (r,) = run_distributed(_run, 1, True)  # world 1: in this process
    rec = r["rec"]
    assert rec["tail_prefixes"] == PREFIXES and rec["tail_width"] == 96 and rec["tail_skipped"] == []
    # CPU: the forward without grad and the backward's rerun under grad: two keys, for all three prefixes
    assert rec["tail_variants"] == 2 == len(r["predicted"]) and {k[1] for k in r["predicted"]} == {96}
    assert r["asked"] == r["predicted"] == r["short"] == r["at32"] == r["one"]
    assert r["others"] == {"bias": [], "auto": []}
    # P = 16's variant compiled already is every P's: nothing left to compile or skip under the limit
    assert r["limited"]["tail_skipped"] == [] and r["limited"]["tail_variants"] == 2
    ran, lines = r["ran"]
    assert ran["tail_variants"] == 2 and ran["tail_compile_s"] > 0 and len(lines) == 2
    what = "1 FlexAttention tail variant (P=16,32,48; keys padded to 96)"
    assert lines == [f"chunkflow: compiling {what} for steps 0-4: 0/1", lines[1]]
    assert lines[1].startswith(f"chunkflow: compiling {what}: 1/1, ")


def test_predicted_tail_variants_are_the_ones_the_steps_ask_for() -> None:
    (r,) = run_distributed(_run, 1, False)  # world 1: in this process
    rec = r["rec"]
    assert rec["tail_prefixes"] == PREFIXES and rec["tail_compile_s"] == 0.0 and rec["tail_skipped"] == []
    seen = [{p for s in steps for p in s} for steps in (r["per_step"], r["per_step"][:-1])]
    assert sorted(seen[0]) == PREFIXES and 32 not in seen[1]
    # CPU: no flex backward, so the forward runs without grad and the backward would rerun it under grad: two each
    assert rec["tail_variants"] == 2 * len(PREFIXES) == len(r["predicted"])
    assert {k[1] for k in r["predicted"]} == {16 + p for p in PREFIXES}  # the keys' length: P + C
    assert r["asked"] == r["predicted"]
    # a prediction that stops one step early misses the variant only step 4 needs: the comparison catches it
    assert r["asked"] - r["short"] == r["at32"] and r["at32"]
    assert r["one"] == r["at32"]  # the warm-up's own chunk asks for exactly the key it stands for
    assert r["others"] == {"bias": [], "auto": []}
    assert r["limited"]["tail_skipped"] == [48] and r["limited"]["tail_variants"] == 4
    ran, lines = r["ran"]
    assert ran["tail_variants"] == 6 and ran["tail_compile_s"] > 0 and len(lines) == 4
    assert lines[0] == "chunkflow: compiling 3 FlexAttention tail variants (P=16,32,48) for steps 0-4: 0/3"
    assert lines[-1].startswith("chunkflow: compiling 3 FlexAttention tail variants (P=16,32,48): 3/3, ")


def test_no_prediction_without_packed_tails() -> None:
    """pack_tails off (or ChunkFlow off): nothing planned, nothing warmed."""
    from types import SimpleNamespace

    from megasparse.chunkflow import tailwarm

    cf = SimpleNamespace(pack=True, pack_tails=False)
    assert tailwarm.tail_prefixes(cf, range(3)) == {}
    assert tailwarm.warm_tails(None, range(3)) is None


@pytest.mark.gpu
def test_steps_after_the_warm_up_compile_no_tail_variant() -> None:
    """CUDA, bf16 on flex: after ``warm_tails`` the steps add no entry to the tail wrappers' dynamo caches, which hold
    one entry each: the padded keys' one variant for every prefix."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from megasparse.chunkflow import tailwarm

    def run() -> tuple[list[int], list[int], dict]:
        torch._dynamo.reset()  # this test counts the wrappers' entries from none
        for keys in (tail_flex._SHAPES, tail_flex.WARMED, tail_flex.REQUESTED):
            keys.clear()
        tr = _trainer(["train.device=cuda", "train.dtype=bf16", "parallel.backend=nccl"])
        rec = tailwarm.warm_tails(tr.chunkflow, range(STEPS))
        before = tail_flex.compiled_entries()
        for _ in range(STEPS):
            tr.train_step()
        return before, tail_flex.compiled_entries(), rec

    (got,) = run_distributed(run, 1)
    before, after, rec = got
    assert rec["tail_prefixes"] == PREFIXES and rec["tail_width"] == 96 and rec["tail_compile_s"] > 0
    assert rec["tail_variants"] == 1 and before == after == [1, 1]  # one variant for the three prefixes
    assert tail_flex.WARMED >= tail_flex.REQUESTED


def _bench(out: str) -> dict:
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_chunkflow as bc

    args = ["cpu_tiny", "--modes", "chunkflow", "--warmup", "0", "--steps", "2", "--out-dir", out, "--data-dir",
            str(Path(out) / "data"), "chunkflow.pack_tails=true", "data.document_attention_kernel=flex"]  # fmt: skip
    assert bc.main(args) == 0
    return json.loads((Path(out) / "chunkflow_cpu_tiny.json").read_text())["cases"][0]


def test_bench_chunkflow_records_the_tail_warm_up(tmp_path) -> None:
    """The benchmark warms its tails' variants before timing and records them in its case (CPU: none compiled)."""
    (case,) = run_distributed(_bench, 1, str(tmp_path))
    assert case["mode"] == "chunkflow" and case["real_tokens_per_s"] > 0, case
    prefixes = case["tail_prefixes"]
    assert prefixes and all(p % 32 == 0 for p in prefixes)  # multiples of the chunk (cpu_tiny: S 128, chunks of 32)
    # one variant (two keys on CPU's no-grad + rerun route) for every prefix: the keys padded to S = 128
    assert case["tail_width"] == 128 and case["tail_variants"] == 2 and case["tail_compile_s"] == 0.0
