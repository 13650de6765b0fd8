"""ChunkFlow's benchmark (issue 30): real tokens/s and peak memory on long-tail data, three ways, one call.

    torchrun --nproc_per_node 4 benchmarks/bench_chunkflow.py 4gpu_8b32l   # the whole Llama-3-8B, TP 2 x PP 2 + SP
    torchrun --nproc_per_node 4 benchmarks/bench_chunkflow.py 4gpu_8b [--modes mcore-fixed,padded,chunkflow]
        [--max-length 32768[,65536]] [--longer-modes chunkflow] [--docs 10000] [--chunk-size 8192]
        [--max-chunks 2] [--warmup 1] [--steps 3] [--data PREFIX] [--out-dir DIR] [section.key=value ...]
    python benchmarks/bench_chunkflow.py cpu_tiny --out-dir /tmp/cf      # smoke test of the code path, CPU

Data. A long-tail set written by ``megasparse data longtail`` (``megasparse/data/longtail.py``) with the
layout's vocabulary and ``--max-length`` S, built once per spec under ``--data-dir`` (local rank 0 builds, the
others wait) unless ``--data`` names one: per document, with probability 0.95 a log-normal length of median
S/40 and log-sd 0.95, else log-uniform in [S/8, S]; clipped to [16, S]; random Zipf-like token ids, EOD = 0.
At S = 32768 and 10000 documents that is median ~870 tokens, mean ~1.9K, p90 ~3.8K (90% at or below 4K), p99
~21K, max ~32K; the 9% of documents above 4K hold half of the tokens. The JSON carries the spec and the
training split's :func:`~megasparse.data.lengths.length_report` (``distributions`` per S; ``distribution``: the
first S's).

Layouts: ``4gpu_8b`` (8 Llama-3-8B layers, TP 2 x PP 2 + SP, 8 windows per step; default modes ``mcore-fixed``,
``padded``, ``chunkflow``) and ``4gpu_8b32l`` (all 32 layers, the same layout and batch; default modes
``mcore-fixed``, ``padded/full``, ``chunkflow``, and chunks of 4096 at K = 5: at S = 32768 the packed windows need
full recompute on 80 GB; chunks of 8192 at K = 2 ran out of memory on four H100s, 4096 at K = 5 fit at 71.7 GiB, what
``megasparse plan ... --gpu-gib 79.2`` names first).

Modes, each on the same data and model, every rank in the same process group:

* ``mcore-fixed``: megatron-core's GPTModel (``benchmarks/mcore_anchor.py``'s ``McoreTrainer``, flash attention
  through SDPA) at fixed length S: every micro-batch is one whole sequence padded to S with EOD, the training
  split's sequences in ``SequenceDataset``'s seeded order (``step_sequences``), global batch sequences per step.
  Its loss averages over the padding too (the anchor has no loss mask; the cost is the same). Needs CUDA. On
  ``4gpu_8b32l`` it runs with Megatron-LM's full recompute (``model.recompute=full``): 32K-token sequences of the
  whole 8B do not fit 80 GB otherwise, there as here.
* ``padded``: megasparse packing the document stream into windows of S (``data.document_attention=true``: no
  attention across a document boundary, positions restart). Packing leaves no padding: every token is real; a
  document that straddles a window boundary is trained as two pieces.
* ``padded/causal``: the same windows with plain causal attention (what document attention costs; not in the
  default list).
* ``padded/selective``, ``padded/full``: ``padded`` with ``model.recompute`` selective or full, what packing needs
  to fit once S outgrows memory (not in the default list; e.g. ``--longer-modes padded/selective,chunkflow``).
  ``vs_padded`` compares with the fastest of ``padded`` and these two at the same S (``padded_ref`` names it): a
  user packs with the least recompute that fits, and ChunkFlow should beat that, not an out-of-memory row.
* ``chunkflow``: megasparse with ChunkFlow (``chunkflow.enabled``, ``chunkflow.chunk_size``,
  ``chunkflow.max_chunks_in_memory``, ``chunkflow.sequences_in_flight`` = ``--in-flight``): see
  :func:`chunkflow_overrides`. Its step takes as many whole sequences as hold one ``padded`` step's tokens on
  average (``--chunkflow-batch``, :func:`chunkflow_batch`): both then take optimizer steps of the same size, and
  the pipeline gets as many chunks per step as packing gets windows' worth. ``mcore-fixed`` keeps the layout's
  global batch (its time per real token does not depend on it: every sequence is its own padded micro-batch).
* ``chunkflow`` on CUDA at bf16 packs short sequences into long ones' last chunks too (``chunkflow.pack_tails``
  null: on where those chunks run FlexAttention, decision 1248); its one FlexAttention variant compiles before the
  warm-up step (``tail_compile_s``). ``chunkflow/tails`` and ``chunkflow/notails`` force ``chunkflow.pack_tails``
  true and false, so both settings time in one call; ``chunkflow/rendezvous`` sets ``chunkflow.free_sends=false``
  (the pipeline's transfers before decision 1249). None is in the default lists. ``--in-flight`` sets
  ``chunkflow.sequences_in_flight`` for every ChunkFlow row (default: the config's).

Several maximum lengths (``--max-length 32768,65536``): every mode runs at the first, ``--longer-modes`` (default
``chunkflow`` when ``--modes`` has it; the modes it names run even if ``--modes`` lacks them) at the others, each on
its own set generated with that S (same shape, scaled) and the same chunk size (default: the layout's, else a quarter
of the first S or of the layout's S, whichever is smaller: 8192 on ``4gpu_8b`` for S = 32768 and for S = 65536 alone);
``mem_vs_first_length`` is a row's peak memory over the same mode's at the first S (issue 30: ChunkFlow's within
10% when S doubles).

A mode whose keys this checkout's config does not know is a row ``not available: ...``, not a crash; so is
``mcore-fixed`` without CUDA. Metrics per mode: ``real_tokens_per_s`` (the timed steps' non-padding input tokens,
global, over their summed times, each step the slowest rank's: ChunkFlow's steps differ in size, so a median step
over mean tokens would mix steps; before 2026-11-28 it was the median), ``step_ms`` (their mean; ``step_ms_each``),
``mem_gib`` (peak allocated per GPU during the timed
steps, max over ranks, less what earlier cases left behind), ``padding_share``, ``chunk_fill`` (ChunkFlow: real
predictions over its chunks' label slots, the timed steps' mean; ``chunkflow.pack_tails`` raises it; its packed last
chunks' FlexAttention variants are compiled before the warm-up steps: ``tail_prefixes``, ``tail_width`` (their
keys' padded length: one variant, decision 1248), ``tail_variants`` and ``tail_compile_s``, the slowest rank's,
decision 1241). Real tokens per step:
``mcore-fixed`` counts its sequences' tokens (capped at S); the megasparse modes take the trainer's
``StepResult.extra["real_tokens"]`` (global) when it reports one, else ``StepResult.tokens`` x dp (packing: all
real). Writes ``chunkflow_<layout>.json`` (``device``, ``layout``, ``distribution``, ``cases`` with ``mode`` and
``real_tokens_per_s``, ratios against ``mcore-fixed`` and ``padded``) after every case (``partial`` until the end)
and prints the table last.

Memory fit on a smaller card: ``--gpu-memory-gib 79.1`` caps each rank's allocator as an 80 GB H100 would (on an
H200, whose 141 GB hold packing with selective recompute at S = 32768), so a mode that would not fit runs out of
memory; the JSON records the cap (``memory_cap_gib``) and ``PYTORCH_CUDA_ALLOC_CONF``. The cap counts the allocator
only: on the 80 GB card the CUDA context and NCCL's buffers come out of the same memory, so a peak close to the cap
is not proven to fit there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_trainer as bt  # noqa: E402

from megasparse.chunkflow.config import frees_sends, tails_packed  # noqa: E402
from megasparse.chunkflow.tailwarm import warm_tails  # noqa: E402
from megasparse.config import ConfigError, load_config  # noqa: E402
from megasparse.configbase import parse_with_overrides  # noqa: E402
from megasparse.data.cache import build_once, local_rank  # noqa: E402
from megasparse.data.lengths import length_report  # noqa: E402
from megasparse.data.longtail import LongTailSpec, write_longtail  # noqa: E402
from megasparse.data.sequences import build_sequence_datasets  # noqa: E402
from megasparse.ops import tail_flex  # noqa: E402
from megasparse.parallel import state  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
_TINY = ["train.device=cpu", "parallel.backend=gloo", "train.dtype=fp32", "parallel.tp=1", "model.num_layers=2",
         "model.hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2",
         "model.ffn_hidden_size=128", "model.vocab_size=512", "train.global_batch_size=4",
         "data.valid_fraction=0.1"]  # fmt: skip
LAYOUTS: dict[str, dict] = {
    # name: config, ranks, overrides, default maximum length S, default number of documents; optional: the default
    # modes (``MODES``), megatron-core's overrides (none), the chunk size (S / 4) and K (2)
    "4gpu_8b": dict(config="configs/gpu_8b8l_tp2_pp2_sp.yaml", ranks=4, overrides=[], max_length=32768, docs=10000),
    # the whole Llama-3-8B: windows of 32K fit 80 GB only with full recompute (`megasparse plan`: 114 GiB without,
    # 95 selective, 40 full at TP 2 x PP 2 + SP), megatron-core's too; ChunkFlow's chunks of 4096 at K = 5 need none
    # (`megasparse plan ... --gpu-gib 79.2`; 8192 at K = 2 ran out of memory on four H100s, 2026-11-28)
    "4gpu_8b32l": dict(
        config="configs/gpu_8b_tp2_pp2_sp.yaml",
        ranks=4,
        overrides=["train.global_batch_size=8"],
        max_length=32768,
        docs=10000,
        modes=("mcore-fixed", "padded/full", "chunkflow"),
        mcore=["model.recompute=full"],
        chunk=4096,
        keep=5,
    ),
    "cpu_tiny": dict(config="configs/cpu_toy.yaml", ranks=1, overrides=_TINY, max_length=128, docs=1500),
}
MODES = ("mcore-fixed", "padded", "chunkflow")
EXTRA_MODES = ("padded/causal", "padded/selective", "padded/full", "chunkflow/tails", "chunkflow/notails",
               "chunkflow/rendezvous")  # fmt: skip
# ChunkFlow's rows: whole sequences per step, chunks of --chunk-size
CHUNKED = ("chunkflow", "chunkflow/tails", "chunkflow/notails", "chunkflow/rendezvous")
PACKED = ("padded", "padded/selective", "padded/full")  # packing with document attention: vs_padded's reference
MCORE = "mcore-fixed"


def chunkflow_overrides(a: argparse.Namespace, batch: int | None = None) -> list[str]:
    """The chunkflow mode's trainer config (docs/chunkflow.md), on top of the layout's and the data's: whole
    sequences through ``SequenceDataset.step_sequences``, one chunk per micro-batch; the trainer reports the step's
    global real tokens in ``StepResult.extra["real_tokens"]``. ``batch``: sequences per step (None: the layout's
    global batch)."""
    return [
        *([] if batch is None else [f"train.global_batch_size={batch}"]),
        *([] if a.in_flight is None else [f"chunkflow.sequences_in_flight={a.in_flight}"]),
        "chunkflow.enabled=true",
        f"chunkflow.chunk_size={a.chunk_size}",
        f"chunkflow.max_chunks_in_memory={a.max_chunks}",
        "data.document_attention=true",
        f"model.seq_length={a.chunk_size}",  # a chunk is a micro-batch window
        "train.micro_batch_size=1",
    ]


def mode_overrides(mode: str, a: argparse.Namespace, batch: int | None = None) -> list[str]:
    """A megasparse mode's overrides (``mcore-fixed`` runs megatron-core on the base config)."""
    return {
        MCORE: list(a.mcore_overrides),
        "padded": ["data.document_attention=true"],
        "padded/selective": ["data.document_attention=true", "model.recompute=selective"],
        "padded/full": ["data.document_attention=true", "model.recompute=full"],
        "padded/causal": [],
        "chunkflow": chunkflow_overrides(a, batch) if a.chunk_size else [],
        "chunkflow/tails": [*chunkflow_overrides(a, batch), "chunkflow.pack_tails=true"] if a.chunk_size else [],
        "chunkflow/notails": [*chunkflow_overrides(a, batch), "chunkflow.pack_tails=false"] if a.chunk_size else [],
        # the transfers before decision 1249: rendezvous batches, one table slot per op
        "chunkflow/rendezvous": [*chunkflow_overrides(a, batch), "chunkflow.free_sends=false"] if a.chunk_size else [],
    }[mode]


def chunkflow_batch(a: argparse.Namespace, cfg, lengths, dp: int) -> int | None:
    """Sequences per ChunkFlow step: ``--chunkflow-batch``; 0 (default): as many as hold the tokens of one
    ``padded`` step (G windows of S) on average, a multiple of the DP size, so both modes take optimizer steps of
    the same size and ChunkFlow's pipeline gets as many chunks per step as packing gets windows' worth; -1: the
    layout's global batch (as ``mcore-fixed``). ``lengths``: the training sequences' lengths."""
    if a.chunkflow_batch > 0:
        return a.chunkflow_batch
    if a.chunkflow_batch < 0:
        return None
    mean = max(1.0, float(lengths.mean()))
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    return max(dp, round(tokens / mean / dp) * dp)


def ensure_data(a: argparse.Namespace, vocab: int, max_length: int) -> str:
    """The long-tail set's prefix: ``--data``, or the spec's set for this S built once under ``--data-dir``."""
    if a.data:
        return a.data
    min_len = min(16, max(2, max_length // 256))  # 16 at S >= 4096; tiny S keeps some spread
    spec = LongTailSpec(docs=a.docs, vocab=vocab, max_length=max_length, seed=a.data_seed, min_length=min_len)
    tag = hashlib.sha1(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:10]
    target = Path(a.data_dir) / f"longtail-{tag}"
    build_once(target, lambda d: write_longtail(d / "longtail", spec), builder=local_rank() == 0)
    return str(target / "longtail")


def mcore_stream(cfg, seqs, dp_rank: int, dp: int, dev: torch.device):
    """This DP rank's micro-batches for megatron-core: step t's global sequences ``t*G ... t*G+G-1`` (G the global
    batch), one per micro-batch, dealt out round-robin over DP, each padded with EOD to S+1 tokens."""
    s, g_batch = cfg.model.seq_length, cfg.train.global_batch_size
    t = 0
    while True:
        for _, toks in seqs.step_sequences(t, g_batch)[dp_rank::dp]:
            row = torch.full((1, s + 1), seqs.eod_id, dtype=torch.int64)
            n = min(len(toks), s + 1)
            row[0, :n] = torch.from_numpy(toks[:n])
            yield row.to(dev, non_blocking=True)
        t += 1


def mcore_real_tokens(cfg, seqs, step: int) -> int:
    """Real input tokens of global step ``step`` under ``mcore-fixed``: each sequence's tokens, capped at S."""
    g_batch = cfg.train.global_batch_size
    ids = [seqs.global_index(g) for g in range(step * g_batch, (step + 1) * g_batch)]
    return int(sum(min(int(seqs.lengths[i]), cfg.model.seq_length) for i in ids))


def run_case(mode: str, cfg, seqs, vocab: int, warmup: int, steps: int) -> dict:
    """Build one mode, warm up, time ``steps`` steps: per-rank seconds, real tokens per step, peak GiB, losses."""
    import mcore_anchor

    bt._free()
    leftover = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    lay = state.layout()
    fills: list[float] = []  # ChunkFlow: the chunks' fill (real / label slots) of each timed step
    tail = None  # chunkflow.pack_tails: the tail-flex warm-up's record (tailwarm.warm_tails)
    if mode == MCORE:
        dev = torch.device("cuda", torch.cuda.current_device())
        num_mb = cfg.num_microbatches(lay.dp)
        mt = mcore_anchor.McoreTrainer(
            cfg, cfg.padded_vocab(vocab), lambda: mcore_stream(cfg, seqs, lay.dp_rank, lay.dp, dev), num_mb, "sdpa"
        )
        step_no = iter(range(1 << 30))

        def step():
            loss, sec = mt.train_step()
            return loss, sec, mcore_real_tokens(cfg, seqs, next(step_no))

        keep = mt
    else:
        from megasparse.train import Trainer

        tr = Trainer(cfg, init_groups=False)
        dev = tr.device
        tail = warm_tails(tr.chunkflow, range(warmup + steps))  # pack_tails' flex compiles, outside the timing

        def step():
            bt._sync(dev)
            r = tr.train_step()
            if "chunk_fill" in r.extra:
                fills.append(r.extra["chunk_fill"])
            return r.loss, r.seconds, int(r.extra.get("real_tokens", r.tokens * tr.dp))

        keep = tr
    losses, times, real = [], [], []
    for _ in range(warmup):
        losses.append(step()[0])
    bt._reset_peak(dev)
    for _ in range(steps):
        loss, sec, n = step()
        losses.append(loss)
        times.append(sec)
        real.append(n)
    mem = bt._peak_gib(dev) - leftover
    if tail is not None:  # what dynamo really compiled for the tails by now (flex call, mask builder): the warm-up's?
        tail["tail_cache_entries"] = tail_flex.compiled_entries()
    if getattr(keep, "graphs", None) is not None:
        keep.graphs.release()
    del keep, step
    bt._free()
    fill = statistics.mean(fills[warmup:]) if fills[warmup:] else None
    losses = [x for x in losses if x is not None]
    return {"times": times, "real": real, "mem_gib": mem, "losses": losses, "dev": dev, "chunk_fill": fill,
            "tail": tail}  # fmt: skip


def case_row(mode: str, cfg, r: dict, world: int, max_length: int) -> dict:
    """The timed steps (each the slowest rank's): mean step, real tokens per second over their summed time (global
    and per GPU), memory and padding share."""
    dev = r["dev"]
    times = bt.gather_floats(r["times"], dev)
    mems = [x[0] for x in bt.gather_floats([r["mem_gib"]], dev)]
    each = [max(t[i] for t in times) for i in range(len(times[0]))]  # per step, the slowest rank
    step_s = statistics.mean(each)
    real = statistics.mean(r["real"])
    slots = cfg.train.global_batch_size * cfg.model.seq_length
    tail = r.get("tail") or {}
    compile_s = max(x[0] for x in bt.gather_floats([tail.get("tail_compile_s", 0.0)], dev))  # the slowest rank's
    return {
        "mode": mode,
        "max_length": max_length,
        "step_ms": 1e3 * step_s,
        "step_ms_each": [1e3 * t for t in each],
        "real_tokens_per_step": real,
        "real_tokens_each": list(r["real"]),
        "real_tokens_per_s": real / step_s,
        "real_tokens_per_s_per_gpu": real / step_s / world,
        "padding_share": max(0.0, 1 - real / slots) if mode == MCORE else 0.0,
        "mem_gib": None if any(math.isnan(m) for m in mems) else max(mems),
        "mem_gib_per_rank": None if any(math.isnan(m) for m in mems) else mems,  # which stage peaks (decision 1247)
        "recompute": cfg.model.recompute,  # mcore-fixed's too: the anchor maps full to Megatron-LM's full recompute
        "max_chunks_in_memory": cfg.chunkflow.max_chunks_in_memory if cfg.chunkflow.enabled else None,
        "pack_tails": tails_packed(cfg, dev.type == "cuda") if cfg.chunkflow.enabled else None,  # as resolved
        "sequences_in_flight": cfg.chunkflow.sequences_in_flight if cfg.chunkflow.enabled else None,
        "free_sends": frees_sends(cfg) if cfg.chunkflow.enabled else None,  # decision 1249
        "seq_length": cfg.model.seq_length,
        "global_batch_size": cfg.train.global_batch_size,
        "chunk_fill": r["chunk_fill"],  # ChunkFlow: real / label slots of its chunks (decision 1233); else None
        # pack_tails (decision 1241): the tail-flex variants compiled before the timed steps and their seconds
        "tail_prefixes": tail.get("tail_prefixes"),
        "tail_width": tail.get("tail_width"),  # the keys padded to it: one variant for every prefix (decision 1248)
        "tail_variants": tail.get("tail_variants"),
        "tail_compile_s": compile_s if tail else None,
        "tail_cache_entries": tail.get("tail_cache_entries"),  # CUDA: [flex, mask] entries; = variants if none late
        "losses": r["losses"],
    }


def add_ratios(cases: list[dict]) -> None:
    """Each timed row's real tokens/s over ``mcore-fixed``'s and over the fastest packing row's (``PACKED``, named
    in ``padded_ref``) at the same S (> 1: more real tokens per second), and its peak memory over the same mode's
    at the first S (``mem_vs_first_length``: ChunkFlow's should stay near 1 when S doubles)."""
    timed = [c for c in cases if "error" not in c]
    first_s = timed[0]["max_length"] if timed else None
    by = {(c["mode"], c["max_length"]): c for c in timed}
    for c in timed:
        r = by.get((MCORE, c["max_length"]))
        c["vs_mcore_fixed"] = c["real_tokens_per_s"] / r["real_tokens_per_s"] if r else None
        packed = [x for x in timed if x["mode"] in PACKED and x["max_length"] == c["max_length"]]
        r = max(packed, key=lambda x: x["real_tokens_per_s"], default=None)
        c["vs_padded"] = c["real_tokens_per_s"] / r["real_tokens_per_s"] if r else None
        c["padded_ref"] = r["mode"] if r else None
        r = by.get((c["mode"], first_s))
        ok = r is not None and r is not c and c["mem_gib"] is not None and r["mem_gib"]
        c["mem_vs_first_length"] = c["mem_gib"] / r["mem_gib"] if ok else None


def format_table(rep: dict) -> str:
    head = (
        f"{'mode':<16} {'S':>6} {'G':>5} {'step ms':>9} {'real tok/s':>11} {'/GPU':>9} {'padding':>8} {'mem GiB':>8} "
        f"{'vs mcore':>9} {'vs padded':>9} {'mem/S0':>7}"
    )
    lines = [f"chunkflow | {rep['device']} | {rep['layout']}: {rep['shape']}", *rep["data_lines"], head]
    lines.append("-" * len(head))
    for c in rep["cases"]:
        if "error" in c:
            lines.append(f"{c['mode']:<16} {c['max_length']:>6} {c['error'][:110]}")
            continue

        def f(key, spec, c=c):
            return bt.cell(c, key, spec)

        lines.append(
            f"{c['mode']:<16} {c['max_length']:>6} {c['global_batch_size']:>5} {c['step_ms']:9.1f} "
            f"{c['real_tokens_per_s']:11.0f} {c['real_tokens_per_s_per_gpu']:9.0f} {100 * c['padding_share']:7.1f}% "
            f"{f('mem_gib', '8.2f')} {f('vs_mcore_fixed', '9.3f')} {f('vs_padded', '9.3f')} "
            f"{f('mem_vs_first_length', '7.3f')}"
        )
    lines.append(
        "G: sequences (windows for packing) per step; real tok/s: non-padding input tokens per second, all GPUs; "
        "vs: real tokens/s over that mode's at the same S (> 1: faster; padded: the fastest packing row); "
        "mem/S0: peak memory over the same mode's at the first S"
    )
    return "\n".join(lines)


def write_report(out: Path, rep: dict, partial: bool) -> None:
    rep["partial"] = partial
    add_ratios(rep["cases"])
    rep["table"] = format_table(rep)
    if not dist.is_initialized() or dist.get_rank() == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rep, indent=1))
        if not partial:
            print(rep["table"], flush=True)


def _config(a, lay: dict, prefix: str, max_length: int, extra: list[str]):
    base = [
        *lay["overrides"],
        f"data.prefix={prefix}",
        f"data.tokenizer={prefix}.tokenizer.json",
        f"model.seq_length={max_length}",
        "train.micro_batch_size=1",
        "train.eval_interval=0",
        *a.overrides,
    ]
    return load_config(str(ROOT / lay["config"]), base + extra), base


def plan(a: argparse.Namespace, lay: dict, world: int) -> list[dict]:
    """Per maximum length S: its data, base config and every mode's config or why it is not available. Runs
    before any process group exists (local rank 0 builds the data, the others wait); a ConfigError of the base
    config ends the run, a mode's only marks that mode."""
    vocab = load_config(str(ROOT / lay["config"]), lay["overrides"] + a.overrides).model.vocab_size
    runs = []
    for i, s in enumerate(a.max_lengths):
        prefix = ensure_data(a, vocab, s)
        base_cfg, base_ov = _config(a, lay, prefix, s, [])
        base_cfg.validate(world)
        modes = a.modes if i == 0 else a.longer_modes
        train, _, _ = build_sequence_datasets(base_cfg.data, s, vocab)  # read once: the batch and the report
        dp = world // (base_cfg.parallel.tp * base_cfg.parallel.pp)
        batch = chunkflow_batch(a, base_cfg, train.lengths, dp) if set(CHUNKED) & set(modes) else None
        cfgs, unavailable = {}, {}
        for m in modes:
            if m in CHUNKED and not a.chunk_size:
                unavailable[m] = "not available: --chunk-size 0"
                continue
            try:
                cfgs[m] = _config(a, lay, prefix, s, mode_overrides(m, a, batch))[0]
                cfgs[m].validate(world)
            except ConfigError as e:
                unavailable[m] = f"not available: {e}"
        runs.append(dict(S=s, vocab=vocab, prefix=prefix, base=base_cfg, base_ov=base_ov, modes=modes, cfgs=cfgs,
                         unavailable=unavailable, train=train))  # fmt: skip
    return runs


def memory_cap(gib: float | None) -> float | None:
    """``--gpu-memory-gib``: cap this process's CUDA allocator at ``gib`` (an 80 GB card's fit, asked on a larger
    one: ``set_per_process_memory_fraction``; an allocation past it raises out-of-memory as the smaller card
    would, though the smaller card also loses the CUDA context and NCCL's buffers, which the cap does not count).
    None or at least the card's size: no cap."""
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
    if gib is None or gib >= total:
        return None
    torch.cuda.set_per_process_memory_fraction(gib / total)
    return gib


def run(a: argparse.Namespace) -> int:
    lay = LAYOUTS[a.layout]
    a.docs = a.docs or lay["docs"]
    world = state.world_env()[1]
    if world != lay["ranks"]:
        print(f"bench_chunkflow: layout {a.layout} needs {lay['ranks']} ranks, got {world}", file=sys.stderr)
        return 2
    bad = [m for m in a.modes + a.longer_modes if m not in MODES + EXTRA_MODES]
    if bad:
        print(f"bench_chunkflow: unknown modes {bad}; use {list(MODES + EXTRA_MODES)}", file=sys.stderr)
        return 2
    try:
        runs = plan(a, lay, world)
    except ConfigError as e:
        print(f"bench_chunkflow: error: {e}", file=sys.stderr)
        return 2
    base_cfg = runs[0]["base"]
    p, m = base_cfg.parallel, base_cfg.model
    state.init(p.tp, p.pp, p.sequence_parallel, p.backend)
    cuda = torch.cuda.is_available() and base_cfg.train.device != "cpu"
    cap = memory_cap(a.gpu_memory_gib) if cuda else None
    rep: dict = {
        "device": f"{world}x {torch.cuda.get_device_name()}" if cuda else f"{world}x cpu",
        "layout": a.layout,
        "config": lay["config"],
        "overrides": runs[0]["base_ov"],
        "shape": f"{m.num_layers} layers, hidden {m.hidden_size}, heads {m.num_attention_heads}/{m.kv_heads}, "
        f"ffn {m.ffn_size}, vocab {m.vocab_size}, tp {p.tp} pp {p.pp}{' +SP' if p.sequence_parallel else ''}, "
        f"global batch {base_cfg.train.global_batch_size}",
        "torch": torch.__version__,
        "call": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "chunkflow": {"chunk_size": a.chunk_size, "max_chunks_in_memory": a.max_chunks},
        "memory_cap_gib": cap,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "distributions": {},
        "data_lines": [],
        "cases": [],
    }
    out = Path(a.out_dir) / f"chunkflow_{a.layout}.json"
    ok = True
    for run_ in runs:
        s, unavailable = run_["S"], dict(run_["unavailable"])
        if MCORE in run_["cfgs"] and not cuda:
            unavailable[MCORE] = "not available: needs CUDA (megatron-core's anchor synchronises the GPU)"
        train = run_["train"]
        d = length_report(train.lengths, s)
        gen = {"generator": "megasparse data longtail", "docs": a.docs, "seed": a.data_seed, "data": run_["prefix"]}
        rep["distributions"][str(s)] = {**gen, **d}
        rep.setdefault("distribution", rep["distributions"][str(s)])  # the first (main) maximum length's
        rep["data_lines"].append(
            f"S {s}: {len(train)} training sequences, median {d['median']:.0f}, p90 {d['p90']:.0f}, p99 "
            f"{d['p99']:.0f}, max {d['max']} tokens; padding each to S wastes "
            f"{100 * d['windows']['padding_share']:.1f}%"
        )
        for mode in run_["modes"]:
            if mode in unavailable:
                rep["cases"].append({"mode": mode, "max_length": s, "error": unavailable[mode]})
                bt.log0(f"--- {mode} S={s}: {unavailable[mode]}")
                continue
            bt.log0(f"--- {mode} S={s} ---")
            try:
                r = run_case(mode, run_["cfgs"][mode], train, run_["vocab"], a.warmup, a.steps)
            except Exception as e:  # an OOM is a result too; keep going
                traceback.print_exc()
                bt._free()
                rep["cases"].append({"mode": mode, "max_length": s, "error": f"{type(e).__name__}: {e}"})
                write_report(out, rep, partial=True)  # a later case may not finish: the failure is on file now
                ok = False
                continue
            row = case_row(mode, run_["cfgs"][mode], r, world, s)
            ok &= all(math.isfinite(x) for x in row["losses"])
            rep["cases"].append(row)
            bt.log0(f"{mode} S={s}: {row['step_ms']:.1f} ms, {row['real_tokens_per_s']:.0f} real tokens/s")
            write_report(out, rep, partial=True)
    write_report(out, rep, partial=False)
    state.destroy()
    return 0 if ok else 1


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("layout", choices=list(LAYOUTS))
    p.add_argument("overrides", nargs="*", help="extra dotted config overrides for every mode")
    p.add_argument("--modes", default=None, help=f"of {list(MODES + EXTRA_MODES)} (default: the layout's)")
    p.add_argument("--max-length", default=None, help="S, the longest sequence and window (layout's); S1,S2,...: also")
    p.add_argument(
        "--longer-modes",
        default=None,
        help="the modes run at the second and later S, whether or not --modes names them (default: chunkflow if "
        "--modes has it; padded/selective or padded/full: packing with the recompute it needs to fit)",
    )
    p.add_argument("--docs", type=int, default=None, help="documents in the generated set (layout's default)")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--data", default=None, help="use this indexed dataset (with PREFIX.tokenizer.json) instead")
    p.add_argument("--data-dir", default=os.environ.get("MEGASPARSE_CACHE", "/tmp/megasparse-chunkflow"))
    p.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        help="chunkflow.chunk_size (layout's, else min(S, layout S) / 4; 0: skip)",
    )
    p.add_argument("--max-chunks", type=int, default=None, help="chunkflow.max_chunks_in_memory (layout's, else 2)")
    p.add_argument("--chunkflow-batch", type=int, default=0, help="sequences per chunkflow step (0: padded's tokens)")
    p.add_argument("--in-flight", type=int, default=None, help="chunkflow.sequences_in_flight (the config's: 2)")
    p.add_argument(
        "--gpu-memory-gib", type=float, default=None, help="cap each GPU's allocator here (an 80 GB card: 79.1)"
    )
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out-dir", default=os.environ.get("OUT", str(ROOT / "docs" / "benchmarks" / "data")))
    a = parse_with_overrides(p, argv)
    a.max_lengths = [int(x) for x in str(a.max_length or LAYOUTS[a.layout]["max_length"]).split(",") if x]
    lay = LAYOUTS[a.layout]
    a.modes = [m for m in (a.modes or ",".join(lay.get("modes", MODES))).split(",") if m]
    a.mcore_overrides = lay.get("mcore", [])
    if a.longer_modes is None:
        a.longer_modes = [m for m in ("chunkflow",) if m in a.modes]
    else:
        a.longer_modes = [m for m in a.longer_modes.split(",") if m]
    if a.chunk_size is None:  # one chunk size for every S and call: ChunkFlow's memory should not follow S
        a.chunk_size = lay.get("chunk", min(a.max_lengths[0], lay["max_length"]) // 4)
    if a.max_chunks is None:
        a.max_chunks = lay.get("keep", 2)
    return a


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
