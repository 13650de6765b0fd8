"""The start banner: what a run has switched on, in one block on rank 0 before the first step (decision 0021).

Each line names the config keys behind it, so a reader who wants something else knows what to override. Keys that
other features add later (``train.fp8``, ``model.recompute``) are shown when the config has them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megasparse.chunkflow.config import chunkflow_line, known_longest, tails_packed
from megasparse.config import Config
from megasparse.loss.config import resolve_impl
from megasparse.metrics import device_mem_gib, param_counts, short_count
from megasparse.parallel import planner

__all__ = ["RunFacts", "format_banner"]


@dataclass
class RunFacts:
    """What the trainer knows only after building the run (the config alone cannot say)."""

    world: int
    dp: int
    vocab: int
    vocab_padded: int
    device: torch.device
    dtype: torch.dtype
    num_microbatches: int
    kept_rows: int | None
    """Kept tokens per micro-batch when filtering (None: filter.mode=off)."""
    optimizer_mib: float
    sharded: bool
    graphs_off: str | None
    """Why CUDA graphs are off (None: on)."""
    longest_sequence: int | None = None
    """``chunkflow.enabled``: the data's longest sequence (tokens; None: unknown), which sizes the K/V store."""


def _onoff(v: bool) -> str:
    return "on" if v else "off"


def _loss_line(cfg: Config, f: RunFacts) -> str:
    lc, p = cfg.loss, cfg.parallel
    rows = cfg.model.seq_length * cfg.train.micro_batch_size
    impl, why = resolve_impl(lc, rows, f.vocab_padded // p.tp)
    if lc.impl == "auto":
        text = f"auto, by memory: {impl} ({why.split(': ', 1)[-1]})"
        if impl == "materialized" and lc.speed_check and f.device.type == "cuda":  # loss/speed.py
            text += "; timed against cce at the first step"
    else:
        text = lc.impl
    timed = lc.impl == "auto" and lc.speed_check and f.device.type == "cuda"
    if impl == "cce" or timed:
        text += f" | cce maths: {lc.backend or ('gemm' if f.device.type == 'cuda' else 'reference')}"
    if lc.vocab_over_pp:
        text += f" | vocabulary over PP (embedding too: {_onoff(lc.embedding_over_pp)})"
    return text


SPLIT_HINT_GAIN = 0.02
"""The planner's estimated step gain from a better layer split below which the banner says nothing."""


AUTO_MEMORY_SHARE = 0.95
"""Share of the GPU's memory above which the banner warns that ``layer_split: auto``'s split may not fit."""


def _auto_memory_warning(choice, f: RunFacts) -> str:
    """A warning, when the planner puts auto's fullest stage over ``AUTO_MEMORY_SHARE`` of this GPU while the even
    split needs less: the first stage takes the extra layer (on 80 GB cards, every acceleration on the whole 8B at
    seq 4096 is estimated at 76.5 GiB). A warning, not a fallback: a split chosen from each rank's own GPU could
    differ between ranks."""
    total = device_mem_gib(f.device) if f.device.type == "cuda" else None
    if total is None or choice.split == choice.even or choice.peak_gib <= AUTO_MEMORY_SHARE * total:
        return ""
    return (
        f"; WARNING: est. {choice.peak_gib:.1f} GiB on the fullest stage of this {total:.0f} GiB GPU "
        f"(even: {choice.peak_gib - choice.more_gib:.1f}); parallel.layer_split=null if it runs out of memory"
    )


def _split_line(cfg: Config, f: RunFacts) -> str | None:
    """The pipeline line: what ``parallel.layer_split: auto`` resolved to; or, on an even 1F1B split, the planner's
    split when it balances the stages (the last one carries the output layer and its loss, worth blocks at a large
    vocabulary) by an estimated ≥ 2% of the step; else None."""
    from megasparse.configbase import ConfigError

    p = cfg.parallel
    if p.auto_split is not None:
        line = f"layer split {p.auto_split.split} (auto: planner, {p.auto_split.describe()})"
        return line + _auto_memory_warning(p.auto_split, f)
    if p.pp < 2 or p.virtual_stages > 1 or p.layer_split is not None or cfg.loss.vocab_over_pp:
        return None
    if cfg.chunkflow.enabled:
        return None
    try:
        best = planner.auto_split(cfg, f.vocab, f.dp)  # what auto would pick (vocab_over_pp returned above)
    except (ConfigError, ValueError, ZeroDivisionError):  # a hint never stops a run from starting
        return None
    if best.split == best.even or best.gain < SPLIT_HINT_GAIN:
        return None
    text = ",".join(str(n) for n in best.split)  # no spaces: pasted as one override
    return (
        f"layer split {best.even} (even); parallel.layer_split=[{text}] (or parallel.layer_split=auto) balances "
        f"the loss stage: an estimated {100 * best.gain:.1f}% shorter step, {best.more_gib:+.1f} GiB on the fullest "
        "stage (megasparse plan CONFIG)"
    )


def _memory_line(cfg: Config, f: RunFacts) -> str | None:
    """On CUDA, a warning when the planner puts the fullest stage of the configured split over
    ``planner.MEMORY_SHARE`` of this GPU, with the levers that bring it down; else None. ``auto``'s split warns on its
    own line."""
    from megasparse.configbase import ConfigError

    p, cf = cfg.parallel, cfg.chunkflow
    total = device_mem_gib(f.device) if f.device.type == "cuda" else None
    if total is None or p.virtual_stages > 1 or (p.auto_split is not None and not cf.enabled):
        return None
    split = planner.configured_split(cfg)
    longest = f.longest_sequence or known_longest(cfg)
    try:
        if cf.enabled:
            plan = planner.chunkflow_estimate(cfg, split, f.vocab, f.dp, longest)
        else:
            plan = planner.estimate(cfg, split, cfg.loss.vocab_over_pp, f.vocab, f.dp)
    except (ConfigError, ValueError, ZeroDivisionError):  # a hint never stops a run from starting
        return None
    peak = max(s.mem_gib for s in plan.stages)
    if peak <= planner.MEMORY_SHARE * total:
        return None
    if cf.enabled:
        return (
            f"WARNING: est. {peak:.1f} GiB on the fullest stage of this {total:.0f} GiB GPU ({plan.name}; megasparse "
            f"plan CONFIG --longest N); if it runs out of memory: "
            f"{', '.join(_chunkflow_levers(cfg, plan, f, split, longest, planner.MEMORY_SHARE * total))}"
        )
    levers = []
    if cfg.model.recompute != "full":
        levers.append(f"model.recompute=full (now {cfg.model.recompute})")
    if cfg.train.fp8 == "tensorwise" and cfg.train.fp8_keep_transpose:
        levers.append("train.fp8_keep_transpose=false")
    if cfg.train.micro_batch_size > 1:
        levers.append("a smaller train.micro_batch_size")
    levers.append("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True against fragmentation")
    return (
        f"WARNING: est. {peak:.1f} GiB on the fullest stage of this {total:.0f} GiB GPU (megasparse plan CONFIG); "
        f"if it runs out of memory: {', '.join(levers)}"
    )


def _chunkflow_levers(
    cfg: Config, plan, f: RunFacts, split: list[int], longest: int | None, budget: float
) -> list[str]:
    """``_memory_line``'s levers under ChunkFlow (decision 1247): first, when the longest sequence is known, the chunk
    size and K that fit ``budget`` with the fewest reruns (``planner.chunkflow_choices``); fewer chunks held, smaller
    chunks, one sequence in flight, a shorter longest sequence when its K/V store weighs; not
    ``model.recompute=full``, which ChunkFlow refuses (it recomputes whole chunks itself)."""

    cf = cfg.chunkflow
    fullest = max(plan.stages, key=lambda s: s.mem_gib)
    levers = []
    if longest:
        fits = planner.chunkflow_choices(cfg, split, f.vocab, f.dp, longest, budget)
        if fits:
            c = fits[0]
            levers.append(
                f"model.seq_length={c.chunk} chunkflow.max_chunks_in_memory={c.keep} (est. {c.mem_gib:.1f} GiB; "
                f"the longest sequence reruns {c.rerun_tokens} tokens, now {planner.rerun_tokens(cfg, longest)})"
            )
    if cf.max_chunks_in_memory > 1:
        levers.append(
            f"chunkflow.max_chunks_in_memory=1 (now {cf.max_chunks_in_memory}; {fullest.mb_act_gib:.1f} GiB a chunk "
            "on that stage, for a forward again per earlier chunk)"
        )
    levers.append(f"a smaller chunk (model.seq_length, now {cfg.model.seq_length})")
    if cf.pipeline_schedule == "state_aware" and cf.sequences_in_flight > 1:
        levers.append(f"chunkflow.sequences_in_flight=1 (now {cf.sequences_in_flight})")
    if fullest.kv_gib > 0.1 * fullest.mem_gib:
        levers.append(f"a lower chunkflow.max_sequence_length (its K/V store: {fullest.kv_gib:.1f} GiB)")
    levers.append("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True against fragmentation")
    return levers


def format_banner(cfg: Config, f: RunFacts) -> str:
    """A few lines: model and device, layout, token filtering, loss, 2:4, fp8 / recompute when the config has those
    keys, CUDA graphs (and why not), optimizer."""
    m, p, t, fl, sp = cfg.model, cfg.parallel, cfg.train, cfg.filter, cfg.sparsity
    params = sum(param_counts(m, f.vocab_padded))
    dtype = str(f.dtype).replace("torch.", "")
    per_step = f"{t.global_batch_size} x {m.seq_length} = {short_count(t.global_batch_size * m.seq_length)} tokens"
    mbs = f"{f.num_microbatches} micro-batches/step"
    if cfg.chunkflow.enabled:  # whole sequences of any length: the chunk count changes from step to step
        per_step, mbs = f"{t.global_batch_size} whole sequences", "a micro-batch per chunk"
    lines = [
        f"megasparse: {m.num_layers} layers, hidden {m.hidden_size}, vocab {f.vocab} (padded {f.vocab_padded}), "
        f"{short_count(params)} parameters | {f.device.type} {dtype} | {t.steps} steps of {per_step}",
        f"  layout     world {f.world} = tp {p.tp} x pp {p.pp} x dp {f.dp} | sequence parallel "
        f"{_onoff(p.sequence_parallel)} | virtual stages {p.virtual_stages} | {mbs}",
    ]
    hint = _split_line(cfg, f)
    if hint:
        lines.append(f"  pipeline   {hint}")
    memory = _memory_line(cfg, f)
    if memory:
        lines.append(f"  memory     {memory}")
    if cfg.chunkflow.enabled:
        half = f.dtype in (torch.bfloat16, torch.float16)
        lines.append(f"  chunkflow  {chunkflow_line(cfg, tails_packed(cfg, f.device.type == 'cuda', half))}")
    if fl.mode == "off":
        lines.append("  filter     off")
    else:
        per_mb = m.seq_length * t.micro_batch_size
        kept = "" if f.kept_rows is None else f" ({f.kept_rows} of {per_mb} tokens per micro-batch)"
        ref = f", reference {fl.reference}" if fl.scorer == "excess" else ""
        group = f"granularity {fl.granularity}"
        if cfg.chunkflow.enabled:  # chunkflow/filter.py selects over each chunk's real tokens
            kept, group = " of each chunk's real tokens", "granularity chunk"
        lines.append(f"  filter     {fl.mode}, keep ratio {fl.keep_ratio:.2f}{kept}, scorer {fl.scorer}{ref}, {group}")
    lines.append(f"  loss       {_loss_line(cfg, f)}")
    if sp.enabled:
        switch = round(t.steps * (1.0 - sp.dense_finetune_fraction))
        dense = f"dense fine-tuning from step {switch}" if switch < t.steps else "no dense fine-tuning"
        lines.append(
            f"  2:4        on: FFN layers {sp.layers}, masks refreshed every {sp.refresh_interval} steps, {dense}"
        )
    else:
        lines.append("  2:4        off")
    for section, key in (("train", "fp8"), ("model", "recompute")):  # keys other features add
        value = getattr(getattr(cfg, section), key, None)
        if value is not None:
            shown = _onoff(value) if isinstance(value, bool) else str(value)
            lines.append(f"  {key:<10} {shown} ({section}.{key})")
    if getattr(cfg.data, "document_attention", False):
        kernel = getattr(cfg.data, "document_attention_kernel", "bias")
        lines.append(f"  documents  attention within each document, positions restart after each EOD ({kernel} kernel)")
    lines.append(f"  graphs     {'on' if f.graphs_off is None else 'off: ' + f.graphs_off}")
    o = cfg.optim
    lines.append(
        f"  optimizer  AdamW, lr {o.lr:.2e} (warmup {o.warmup_steps}, cosine to {o.min_lr:.2e}) | state "
        f"{f.optimizer_mib:.1f} MiB/rank{' (sharded over dp)' if f.sharded else ''}"
    )
    return "\n".join(lines)
