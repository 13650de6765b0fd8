"""ChunkFlow's memory estimate (decision 1247): the chunks a stage holds against the slot tables, the estimate
against the GPU measurements, the banner's warning and ``megasparse plan``'s table. Pure arithmetic."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from megasparse.chunkflow.schedule import Schedule, gpipe_per_group, simulate, state_aware
from megasparse.config import load_config
from megasparse.parallel.planner import chunkflow_estimate, chunks_held, kv_store_bytes

ROOT = Path(__file__).resolve().parent.parent
GIB = 1024**3
WHOLE, EIGHT = "configs/gpu_8b_tp2_pp2_sp.yaml", "configs/gpu_8b8l_tp2_pp2_sp.yaml"
# the GPU's points below ran without tails packed and one sequence in flight (decisions 1248 and 1249 turned them
# on by default later)
CHUNKS = [
    "model.seq_length=8192",
    "chunkflow.enabled=true",
    "data.document_attention=true",
    "chunkflow.pack_tails=false",
    "chunkflow.sequences_in_flight=1",
]
LONGEST = 32762  # the benchmark's long-tail set's longest sequence: 4 chunks of 8192


def _cfg(path: str, *overrides: str):
    return load_config(str(ROOT / path), [*CHUNKS, "train.global_batch_size=8", *overrides])


def held_peak(s: Schedule) -> list[int]:
    """Per stage, the most chunks at once whose forward kept its graph and whose backward has not run, walking the
    stage's ops in slot order; a rerun's graph counts in its own backward's slot."""
    peaks = []
    for r in range(s.pp):
        live = peak = 0
        for kind, c in s.order(r):
            if kind == "F":
                live += s.kept(c)
            else:
                peak = max(peak, live + (not s.kept(c)))
                live -= s.kept(c)
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def test_chunks_held_bounds_the_slot_tables_and_is_reached() -> None:
    """Random long-tail steps (pp 2-4, K 1-5, one to three sequences in flight, both orders): no stage of a table
    ever holds more graphs than ``chunks_held`` says, the same count for any number in flight (decision 1249), and
    with each order some stages hold exactly that many; on the benchmark's kind of step (a 4-chunk sequence among
    single chunks) K + pp − r on stage r < pp − 1 and K on the last."""
    rng = np.random.default_rng(47)
    reached: dict[tuple[str, int], int] = {}
    for _ in range(150):
        pp, keep, p_long = int(rng.integers(2, 5)), int(rng.integers(1, 6)), rng.random()
        sizes = tuple(int(rng.integers(2, 13)) if rng.random() < p_long else 1 for _ in range(int(rng.integers(1, 16))))
        tables = [("state_aware", w, state_aware(pp, sizes, keep, w)) for w in (1, 2, 3)]
        tables.append(("gpipe", 1, gpipe_per_group(pp, sizes, keep)))
        for order, window, table in tables:
            bound = [chunks_held(order, pp, r, keep, max(sizes), sizes.count(1)) for r in range(pp)]
            peak = held_peak(table)
            assert all(p <= b for p, b in zip(peak, bound)), (order, pp, sizes, keep, window, peak, bound)
            # a stage below the last with single chunks beside a sequence: the case the formula adds up
            full = [p == b for r, (p, b) in enumerate(zip(peak, bound)) if r < pp - 1 and 1 in sizes and max(sizes) > 1]
            reached[(order, window)] = reached.get((order, window), 0) + sum(full)
    # more in flight fill the bubbles with the next sequence's forwards rather than single chunks: within the
    # bound, seldom at it
    reached.pop(("state_aware", 2)), reached.pop(("state_aware", 3))
    assert all(n >= 10 for n in reached.values()), reached
    step = (4,) + (1,) * 20
    for keep in (1, 2):
        assert held_peak(state_aware(2, step, keep)) == [keep + 2, keep]
        assert [chunks_held("state_aware", 2, r, keep, 4) for r in (0, 1)] == [keep + 2, keep]
        assert held_peak(state_aware(4, step, keep)) == [keep + 4, keep + 3, keep + 2, keep]
        assert held_peak(gpipe_per_group(2, step, keep)) == [2, keep]  # the larger of K and pp − r, not their sum
        table = state_aware(3, (3, 1, 5, 1, 1, 1), keep, 2)
        assert held_peak(table) == simulate(table).peak_graphs  # the simulator's own count, stage by stage


def test_kv_store_follows_state_py() -> None:
    """k, v in bf16 and dk, dv in fp32 over the sequence's whole chunks, per layer and TP rank's KV heads: the
    whole 8B's 16-layer stage at tp 2 holds 3 GiB for 4 chunks of 8192; a one-chunk sequence has no store."""
    cfg = _cfg(WHOLE)
    assert kv_store_bytes(cfg, 16, LONGEST) == 16 * 4 * 128 * 32768 * (2 * 2 + 2 * 4) == 3 * GIB
    assert kv_store_bytes(cfg, 16, 8193) == 0.0  # 8192 predictions: one chunk
    assert kv_store_bytes(cfg, 16, 8194) == 16 * 4 * 128 * 16384 * 12


@pytest.mark.parametrize(
    ("path", "keep", "chunk", "measured"),
    [(WHOLE, 2, 8192, 77.1), (WHOLE, 1, 8192, 67.7), (EIGHT, 2, 8192, 23.3), (WHOLE, 5, 4096, 71.74)],
)
def test_estimate_against_the_gpu(path: str, keep: int, chunk: int, measured: float) -> None:
    """Peak allocated, max over the ranks (TP 2 x PP 2 + SP, longest 32762 tokens, state-aware, one sequence in
    flight): chunks of 8192 on four H200s (2026-11-27, the whole 8B with the allocator capped at 79.1 GiB), chunks of
    4096 at K = 5 on four H100s (2026-11-28). The estimate's fullest stage, the first, is 0.03-1.1 GiB below it
    (decision 1247)."""
    split = [16, 16] if path == WHOLE else [4, 4]
    ov = [f"chunkflow.max_chunks_in_memory={keep}", f"model.seq_length={chunk}"]
    plan = chunkflow_estimate(_cfg(path, *ov), split, None, 1, LONGEST)
    peak = max(s.mem_gib for s in plan.stages)
    assert max(range(2), key=lambda r: plan.stages[r].mem_gib) == 0
    assert measured - 1.1 < peak < measured, (peak, measured, plan.notes)
    assert plan.stages[0].act_gib == pytest.approx((keep + 2) * plan.stages[0].mb_act_gib + plan.stages[0].kv_gib)


def test_tails_add_their_padded_keys() -> None:
    """Tails packed on flex (the default, decision 1248): each in-flight sequence's packed last chunk keeps its keys and
    values padded to the longest sequence's chunks, less its own (0.875 GiB for 8 chunks of 4096 on a 16-layer stage
    at tp 2). Measured on four H200s capped at 79.1 GiB (2026-11-28, call D): 72.50 GiB on the first stage, 0.76 more
    than without; the estimate is within 0.2 GiB of it. The bias kernels and no document attention add nothing."""
    from megasparse.parallel.planner import tail_keys_bytes

    ov = ["model.seq_length=4096", "chunkflow.max_chunks_in_memory=5"]
    on = _cfg(WHOLE, *ov, "chunkflow.pack_tails=true")
    assert tail_keys_bytes(on, 16, LONGEST) == 16 * 4 * 128 * 7 * 4096 * 2 * 2 == 0.875 * GIB
    plan = chunkflow_estimate(on, [16, 16], None, 1, LONGEST)
    off = chunkflow_estimate(_cfg(WHOLE, *ov), [16, 16], None, 1, LONGEST)
    assert plan.stages[0].mem_gib - off.stages[0].mem_gib == pytest.approx(0.875)
    assert abs(plan.stages[0].mem_gib - 72.50) < 0.2 and "tail keys 0.875 GiB" in plan.notes[0], plan.notes
    for other in ("data.document_attention_kernel=bias", "data.document_attention=false"):
        assert tail_keys_bytes(_cfg(WHOLE, *ov, "chunkflow.pack_tails=true", other), 16, LONGEST) == 0.0


def test_estimate_grows_with_what_chunkflow_keeps() -> None:
    """A second sequence in flight adds only its keys/values on the first stage (1 GiB of the store's 3: its chunks
    share the stage's budget of graphs and a stage runs one sequence's backwards at a time, so one set of gradient
    buffers, decision 1249; nothing on the last: it ends one sequence before it starts the next); gpipe holds the
    larger of K and pp − r; a longer sequence grows only the K/V store."""
    base = chunkflow_estimate(_cfg(WHOLE), [16, 16], None, 1, LONGEST).stages
    two = chunkflow_estimate(_cfg(WHOLE, "chunkflow.sequences_in_flight=2"), [16, 16], None, 1, LONGEST).stages
    assert two[0].mem_gib - base[0].mem_gib == pytest.approx(1.0)
    assert two[1].mem_gib == base[1].mem_gib
    base = base[0]
    gp = chunkflow_estimate(_cfg(WHOLE, "chunkflow.pipeline_schedule=gpipe"), [16, 16], None, 1, LONGEST).stages[0]
    assert base.mem_gib - gp.mem_gib == pytest.approx(2 * base.mb_act_gib)
    long = chunkflow_estimate(_cfg(WHOLE), [16, 16], None, 1, 4 * LONGEST).stages[0]
    assert long.mem_gib - base.mem_gib == pytest.approx(9.0)


def _facts(longest: int | None, device: str = "cuda"):
    from megasparse.banner import RunFacts

    dev = torch.device(device)
    return RunFacts(4, 1, 128256, 128256, dev, torch.bfloat16, 8, None, 0.0, False, None, longest)


def test_banner_warns_by_chunkflows_estimate(monkeypatch) -> None:
    """The whole 8B in chunks of 8192 with K = 2 (77.1 GiB measured) warns on a 79.2 GiB card with ChunkFlow's
    levers, never full recompute (ChunkFlow refuses it); K = 1 (67.7) does not, nor a 139.8 GiB card or the CPU.
    Unknown data: the synthetic stand-in's 64 chunks, whose K/V store is its own lever."""
    import megasparse.banner as banner

    monkeypatch.setattr(banner, "device_mem_gib", lambda dev: 79.2)
    line = banner._memory_line(_cfg(WHOLE), _facts(LONGEST))
    assert line.startswith("WARNING: est. 76.8 GiB on the fullest stage of this 79 GiB GPU (ChunkFlow"), line
    assert "chunkflow.max_chunks_in_memory=1 (now 2" in line and "model.seq_length, now 8192" in line, line
    # first the choice that fit four real H100s (2026-11-28): chunks of 4096 at K = 5, fewer reruns than now
    best = "model.seq_length=4096 chunkflow.max_chunks_in_memory=5 (est. 71.7 GiB; the longest sequence reruns 12288"
    assert line.split("if it runs out of memory: ")[1].startswith(best + " tokens, now 16384)"), line
    assert "expandable_segments:True" in line and "recompute" not in line and "sequences_in_flight" not in line
    assert "max_sequence_length" not in line  # 3 GiB of K/V: not the lever here
    assert "  memory     WARNING" in banner.format_banner(_cfg(WHOLE), _facts(LONGEST))
    assert banner._memory_line(_cfg(WHOLE, "chunkflow.max_chunks_in_memory=1"), _facts(LONGEST)) is None
    two = banner._memory_line(_cfg(WHOLE, "chunkflow.sequences_in_flight=2"), _facts(LONGEST))
    assert "chunkflow.sequences_in_flight=1 (now 2)" in two and "max_chunks_in_memory=1 (now 2" in two, two
    assert two.startswith("WARNING: est. 77.8 GiB"), two  # a second sequence's keys/values (1 GiB), no more chunks
    stand_in = banner._memory_line(_cfg(WHOLE, "chunkflow.max_chunks_in_memory=1"), _facts(None))
    assert "524288 tokens" in stand_in and "chunkflow.max_sequence_length (its K/V store: 48.0 GiB)" in stand_in
    assert banner._memory_line(_cfg(WHOLE), _facts(LONGEST, "cpu")) is None
    monkeypatch.setattr(banner, "device_mem_gib", lambda dev: 139.8)
    assert banner._memory_line(_cfg(WHOLE), _facts(LONGEST)) is None


def test_plan_prints_chunkflows_estimate(capsys) -> None:
    from megasparse.parallel.planner import main

    args = [str(ROOT / WHOLE), *CHUNKS, "data.prefix=corpus", "train.global_batch_size=8"]
    assert main([*args, "--longest", str(LONGEST)]) == 0
    out = capsys.readouterr().out
    assert "(ChunkFlow: chunks of 8192, K=2, longest sequence 32762 tokens (4 chunks), state_aware" in out, out
    assert "stage 0: 4 chunks held x 10.156 + K/V store 3.000 GiB" in out and "peak memory 76.789 GiB" in out
    assert "fixed windows of 8192 tokens (1F1B, chunkflow.enabled=false): peak 53.477 GiB" in out
    assert main(args) == 0
    assert "pass --longest N" in capsys.readouterr().out


def test_plan_truncates_longest_to_the_configured_limit(capsys) -> None:
    """``--longest`` is the data's longest document; a run truncates it to ``chunkflow.max_sequence_length``
    (``data/sequences.py``), as the banner's ``longest_sequence`` does, so the plan sizes the held chunks and the K/V
    store by the truncated length."""
    from megasparse.parallel.planner import main

    args = [str(ROOT / WHOLE), *CHUNKS, "data.prefix=corpus", "train.global_batch_size=8"]
    assert main([*args, "chunkflow.max_sequence_length=16385", "--longest", str(LONGEST)]) == 0
    out = capsys.readouterr().out
    assert "longest sequence 16385 tokens (2 chunks)" in out and "K/V store 1.500 GiB" in out, out


def test_chunkflow_choices_fit_the_budget_with_fewest_reruns() -> None:
    """Per chunk size (the configured one and its half), the largest K under the budget, fewest reruns first: on an
    80 GB card's 92% the measured fit (4096, K = 5) comes before 8192 at K = 1; a K one larger passes the budget; on
    a 141 GB card both chunk sizes keep every chunk; a budget below the weights finds none."""
    from megasparse.parallel.planner import chunkflow_choices

    cfg = _cfg(WHOLE)
    fits = chunkflow_choices(cfg, [16, 16], None, 1, LONGEST, 0.92 * 79.2)
    assert [(c.chunk, c.keep, c.rerun_tokens) for c in fits] == [(4096, 5, 12288), (8192, 1, 24576)]
    assert all(c.mem_gib <= 0.92 * 79.2 for c in fits)
    over = chunkflow_estimate(_cfg(WHOLE, "model.seq_length=4096", "chunkflow.max_chunks_in_memory=6"), [16, 16],
                              None, 1, LONGEST)  # fmt: skip
    assert max(s.mem_gib for s in over.stages) > 0.92 * 79.2
    big = chunkflow_choices(cfg, [16, 16], None, 1, LONGEST, 0.92 * 139.8)
    assert [(c.chunk, c.keep, c.rerun_tokens) for c in big] == [(8192, 4, 0), (4096, 8, 0)]
    assert chunkflow_choices(cfg, [16, 16], None, 1, LONGEST, 30.0) == []


def test_plan_prints_what_fits_a_gpu(capsys) -> None:
    from megasparse.parallel.planner import main

    args = [str(ROOT / WHOLE), *CHUNKS, "data.prefix=corpus", "train.global_batch_size=8", "--longest", str(LONGEST)]
    assert main([*args, "--gpu-gib", "79.2"]) == 0
    out = capsys.readouterr().out
    assert "fit 72.9 GiB (92% of 79.2; fewest reruns" in out, out
    assert "  model.seq_length=4096 chunkflow.max_chunks_in_memory=5: est. 71.7 GiB, 12288 tokens rerun" in out
    assert main([*args, "--gpu-gib", "30"]) == 0
    assert "none at this chunk size or its half" in capsys.readouterr().out
