"""``megasparse chunkflow plan``: what ChunkFlow's plan makes of a dataset, before any GPU time is spent.

    megasparse chunkflow plan PREFIX --chunk-size C [--max-chunks K] [--per-step N] [--dp D] [--steps 20]
        [--max-length L] [--json]

It draws ``--steps`` steps of ``--per-step`` documents (seeded; no document twice in a step) from the dataset's
document lengths (the ``.idx`` alone) and plans each with :func:`~megasparse.chunkflow.plan.plan_step`, short
documents packed (``data.document_attention``), once with ``chunkflow.pack_tails`` and once without. Per layout:
the fill (real predictions over chunk slots), chunks per step, where the padding sits (long sequences' last chunks,
packed chunks), and the extra chunk forwards that K (``chunkflow.max_chunks_in_memory``) below a sequence's chunk
count costs, each counted as a third of a chunk's forward and backward. ``work/real`` sums them per real prediction;
packing the same documents into windows is 1.0 (no padding, no recompute). Attention and pipeline bubbles are not in
it: ``benchmarks/bench_chunkflow.py`` measures the step. So a ``work/real`` of 1.05 says ChunkFlow cannot beat
packing on this data by more than what packing loses elsewhere (memory, recompute it needs to fit).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from megasparse.chunkflow.plan import plan_step

__all__ = ["format_plan_report", "plan_report"]

RECOMPUTE_SHARE = 1 / 3
"""An extra chunk forward's cost in chunks of forward + backward (a backward is about twice a forward)."""


def _layout(steps: list[list[int]], chunk_size: int, keep: int, dp: int, tails: bool) -> dict:
    real = slots = chunks = extra = long_pad = pack_pad = 0
    for lengths in steps:
        plan = plan_step(lengths, chunk_size, dp, pack=True, tails=tails)
        real, slots, chunks = real + plan.real_tokens, slots + plan.slots, chunks + plan.num_chunks
        for g in plan.groups:
            pad = sum(chunk_size - c.real for c in g.chunks)
            long_pad, pack_pad = (long_pad + pad, pack_pad) if len(g.chunks) > 1 else (long_pad, pack_pad + pad)
            extra += max(0, len(g.chunks) - keep)
    n = len(steps)
    return {
        "fill": real / slots,
        "chunks_per_step": chunks / n,
        "padding_long_tails": long_pad / slots,
        "padding_packed": pack_pad / slots,
        "extra_forwards_per_step": extra / n,
        "work_per_real": (slots + RECOMPUTE_SHARE * extra * chunk_size) / real,
    }


def plan_report(
    lengths: np.ndarray,
    chunk_size: int,
    keep: int = 2,
    per_step: int = 64,
    dp: int = 1,
    steps: int = 20,
    seed: int = 0,
    max_length: int | None = None,
) -> dict:
    """Both layouts' plan statistics over ``steps`` sampled steps of ``per_step`` documents of ``lengths``
    (``max_length``: longer ones truncated to it, as ``chunkflow.max_sequence_length`` does)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    lengths = lengths[lengths >= 2]  # a document of fewer than 2 tokens trains nothing
    if max_length is not None:
        lengths = np.minimum(lengths, max_length)
    if len(lengths) < per_step:
        raise ValueError(f"--per-step {per_step} is more than the dataset's {len(lengths)} trainable documents")
    rng = np.random.default_rng(seed)
    drawn = [[int(x) for x in rng.choice(lengths, per_step, replace=False)] for _ in range(steps)]
    return {
        "documents": int(len(lengths)),
        "chunk_size": chunk_size,
        "max_chunks_in_memory": keep,
        "per_step": per_step,
        "dp": dp,
        "steps": steps,
        "longest_chunks": int(-(-(int(lengths.max()) - 1) // chunk_size)),
        "layouts": {f"pack_tails={str(t).lower()}": _layout(drawn, chunk_size, keep, dp, t) for t in (True, False)},
    }


def format_plan_report(rep: dict) -> str:
    head = (
        f"{'layout':<18} {'fill':>6} {'chunks/step':>11} {'pad long':>8} {'pad packed':>10} {'extra fwd':>9} "
        f"{'work/real':>9}"
    )
    lines = [
        f"chunkflow plan: {rep['documents']} documents, chunks of {rep['chunk_size']}, {rep['per_step']} per step "
        f"({rep['steps']} steps drawn), K={rep['max_chunks_in_memory']}, dp {rep['dp']}; the longest takes "
        f"{rep['longest_chunks']} chunks",
        head,
        "-" * len(head),
    ]
    for name, r in rep["layouts"].items():
        lines.append(
            f"{name:<18} {100 * r['fill']:5.1f}% {r['chunks_per_step']:11.1f} {100 * r['padding_long_tails']:7.1f}% "
            f"{100 * r['padding_packed']:9.1f}% {r['extra_forwards_per_step']:9.1f} {r['work_per_real']:9.3f}"
        )
    lines.append(
        "pad: share of all chunk slots; extra fwd: chunk forwards rerun per step because K < a sequence's chunks; "
        "work/real: chunk work per real prediction (packing into windows: 1.000), attention and bubbles not counted"
    )
    lines.append(
        "pack_tails is on by default where the packed last chunks run FlexAttention (CUDA at bf16/fp16): one "
        "variant compiled before the first step, 23-49 s on H200s and an H100 (decisions 1233, 1248)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="megasparse chunkflow", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="tool", required=True)
    p = sub.add_parser("plan", help="fill, padding and recompute of ChunkFlow's plan on a dataset")
    p.add_argument("prefix", help="indexed dataset prefix (PREFIX.bin/.idx)")
    p.add_argument("--chunk-size", type=int, required=True, help="chunkflow.chunk_size (= model.seq_length)")
    p.add_argument("--max-chunks", type=int, default=2, help="chunkflow.max_chunks_in_memory (K)")
    p.add_argument("--per-step", type=int, default=64, help="sequences per step (train.global_batch_size)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks the groups are dealt to")
    p.add_argument("--steps", type=int, default=20, help="steps to draw")
    p.add_argument("--max-length", type=int, default=None, help="chunkflow.max_sequence_length (truncation)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    a = ap.parse_args(argv)
    for key, v, lo in (("--chunk-size", a.chunk_size, 1), ("--max-chunks", a.max_chunks, 1), ("--per-step",
                       a.per_step, 1), ("--dp", a.dp, 1), ("--steps", a.steps, 1)):  # fmt: skip
        if v < lo:
            print(f"megasparse chunkflow plan: {key}={v} must be >= {lo}", file=sys.stderr)
            return 2
    from megasparse.data.indexed import DataError, IndexedDataset

    try:
        lengths = IndexedDataset(a.prefix).doc_lengths
        rep = plan_report(lengths, a.chunk_size, a.max_chunks, a.per_step, a.dp, a.steps, a.seed, a.max_length)
    except (DataError, ValueError) as e:
        print(f"megasparse chunkflow plan: {e}", file=sys.stderr)
        return 2
    rep["prefix"] = a.prefix
    print(json.dumps(rep, indent=1) if a.json else format_plan_report(rep))
    return 0
