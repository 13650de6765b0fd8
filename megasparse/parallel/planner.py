"""Pipeline layer-split planner: ``megasparse plan CONFIG [section.key=value ...]``.

Transformer blocks are all alike, but the first stage also holds the input embedding and the last
the final norm plus the output layer and its loss, whose matmuls (6·tokens·V·h per micro-batch) can
be worth several blocks at large vocabularies. The planner estimates, per pipeline stage and per TP
rank, one micro-batch's forward+backward FLOPs and the memory of weights + fp32 grads + Adam state
plus the activations 1F1B keeps in flight, for

  (a) the configured split (or the even one) with the vocabulary on the last stage,
  (b) the split that minimises the largest stage cost (embedding and loss included),
  (c) ``loss.vocab_over_pp``: the output layer (and with ``loss.embedding_over_pp`` the input embedding)
      spread evenly over every stage, with its best split.

Estimates are analytic (what the model's matmuls do; the activations each op saves, ``act_elems_per_token``, with
``model.recompute``; fp8's and 2:4's weight copies), meant for ranking splits and for whether a stage fits, not for
absolute times. ``parallel.layer_split: auto`` trains (b)'s split, or (c)'s under ``loss.vocab_over_pp``
(``resolve_layer_split``, decision 1243).

Under ``chunkflow.enabled`` the same per-stage terms give ChunkFlow's memory (``chunkflow_estimate``, decision 1247):
the activations of the chunks a stage holds at once under its pipeline order, each one micro-batch, plus the K/V
store of the sequences in progress; ``megasparse plan`` prints it and the start banner warns by it. With a GPU's
memory (``--gpu-gib``) ``chunkflow_choices`` names the chunk sizes and K that fit, fewest reruns first.

Why this file is long: one home for the analytic stage model; the fixed-window plans and ChunkFlow's estimate share
its per-op activation and state counts, which must not drift apart in two files.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

from megasparse.chunkflow.config import tails_on_flex, tails_packed
from megasparse.chunkflow.schedule import held_budget
from megasparse.config import Config, ConfigError, load_config
from megasparse.configbase import parse_with_overrides
from megasparse.parallel.config import AUTO, AutoSplit

GIB = 1024**3
STATE_BYTES = 16
"""Bytes per parameter held by a stage: fp32 weight + fp32 grad + Adam's two fp32 moments."""


def _elem(cfg: Config) -> int:
    """Bytes of one compute-dtype element: fp32 (or auto on CPU) 4, else 2."""
    return 4 if cfg.train.dtype == "fp32" or (cfg.train.dtype == "auto" and cfg.train.device == "cpu") else 2


def state_bytes(cfg: Config, dp: int) -> float:
    """Bytes per parameter a rank holds. ``STATE_BYTES``, or with ``parallel.distributed_optimizer`` the
    compute-dtype parameter and the fp32 gradient whole, the fp32 master and both moments split over ``dp``."""
    if not cfg.parallel.distributed_optimizer:
        return STATE_BYTES
    return _elem(cfg) + 4 + 12 / dp


def layer_params(cfg: Config) -> int:
    """Matmul parameters of one transformer block (norms are negligible)."""
    m = cfg.model
    d = m.head_dim
    attn = m.hidden_size * (m.num_attention_heads + 2 * m.kv_heads) * d + m.num_attention_heads * d * m.hidden_size
    return attn + 3 * m.hidden_size * m.ffn_size


def layer_flops(cfg: Config, tokens: int) -> float:
    """Forward+backward FLOPs of one block for ``tokens`` tokens: 6·tokens·params + 12·tokens·s·h (attention)."""
    m = cfg.model
    return 6.0 * tokens * layer_params(cfg) + 12.0 * tokens * m.seq_length * m.hidden_size


def loss_flops(cfg: Config, tokens: int, vocab_cols: int) -> float:
    """Forward+backward FLOPs of the output layer on ``vocab_cols`` columns: logits, dE and dC matmuls."""
    return 6.0 * tokens * vocab_cols * cfg.model.hidden_size


def act_elems_per_token(cfg: Config, recompute: str | None = None) -> tuple[float, float, float]:
    """Elements one block saves for its backward per token, as (sequence-sharded under SP, whole on every TP rank,
    split over TP), by what each op keeps: the two norms' inputs; the norms' outputs, which the column-parallel qkv
    and fc1 keep gathered; qkv, RoPE's rotated q and k, the attention output, fc1's [gate | up] and the SwiGLU
    output. ``model.recompute=selective`` drops the rotated q/k and the SwiGLU output (decision 0012). Tensorwise
    fp8 keeps qkv's, fc1's and fc2's inputs in e4m3 (decision 1245).

    Checked on the whole Llama-3-8B at PP 2 × DP 2 on H200s (2026-11-27, first stage, state subtracted): 18.5 GiB
    at seq 4096 (this count: 17.5 plus the embedding's), selective 9.2 GiB less at seq 8192 (this count: 9.5)."""
    m = cfg.model
    h, f = m.hidden_size, m.ffn_size
    q, kv = m.num_attention_heads * m.head_dim, m.kv_heads * m.head_dim
    # tensorwise fp8 with its fp8 weight gradient: qkv, fc1 and (without selective) fc2 keep their inputs as one
    # byte per element, half a bf16 element, a quarter of an fp32 one (decision 1245)
    e4m3 = 1 / _elem(cfg) if cfg.train.fp8 == "tensorwise" and cfg.train.fp8_wgrad else 1.0
    if (recompute or m.recompute) == "selective":
        return 2 * h, 2 * h * e4m3, 2 * q + 2 * kv + 2 * f
    return 2 * h, 2 * h * e4m3, 3 * q + 3 * kv + (2 + e4m3) * f


def act_bytes_per_layer(cfg: Config, tokens: int, elem: int, recompute: str | None = None) -> float:
    """Activations one block saves for backward for one micro-batch, on one TP rank, under ``recompute`` (default:
    ``model.recompute``); ``full`` keeps only the block's input (the estimate adds the one block the backward
    rebuilds at a time: this with ``recompute="none"``)."""
    t, sp = cfg.parallel.tp, cfg.parallel.sequence_parallel
    seq_shards = t if sp else 1
    recompute = recompute or cfg.model.recompute
    if recompute == "full":
        return cfg.model.hidden_size / seq_shards * tokens * elem
    residual, whole, split = act_elems_per_token(cfg, recompute)
    return (residual / seq_shards + whole + split / t) * tokens * elem


def feature_bytes_per_layer(cfg: Config) -> float:
    """Weight-sized memory features add to one block on one TP rank: ``train.fp8``'s two e4m3 copies of each
    matmul weight (W for the forward, Wᵀ for the input gradient); 2:4's masks (one byte per FFN weight) and, without
    fp8, its cuSPARSELt operands of W and Wᵀ (half the values in bf16 plus metadata: ~1.125 bytes each; not measured
    at 8B). On the whole 8B's first stage fp8 read 6.6 GiB over bf16 and fp8 with 2:4 9.3 (2026-11-27). Without the
    distributed optimizer, the dense linears' compute-dtype copies of their fp32 masters (``_copies``)."""
    extra = 0.0
    ffn = 3 * cfg.model.hidden_size * cfg.model.ffn_size
    if cfg.train.fp8 != "off":  # W and Wᵀ, or W alone with train.fp8_keep_transpose=false (decision 1245)
        extra += (2 if cfg.train.fp8_keep_transpose else 1) * layer_params(cfg)
    if cfg.sparsity.enabled:
        extra += ffn * (1 if cfg.train.fp8 != "off" else 1 + 2 * 1.125)
    if _copies(cfg) and cfg.train.fp8 == "off":  # the dense linears' compute copies (fp8's and 2:4's GEMMs keep
        extra += (layer_params(cfg) - (ffn if cfg.sparsity.enabled else 0)) * _elem(cfg)  # their own operands)
    return extra / cfg.parallel.tp


def _copies(cfg: Config) -> bool:
    """Whether the linears and the output layer keep compute-dtype copies of fp32 masters (``ComputeCopies``,
    decision 0009): without the distributed optimizer (whose parameters are the compute copies) below fp32."""
    return not cfg.parallel.distributed_optimizer and _elem(cfg) < 4


@dataclass
class StageEstimate:
    """One pipeline stage on one TP rank."""

    layers: int
    parts: str
    """Extra pieces on this stage: emb, loss, embN% (its share of the input embedding), loss/p (1/pp of the output)."""
    flops: float
    """Forward+backward FLOPs per micro-batch."""
    params: float
    state_gib: float
    """Weights + grads + Adam state."""
    act_gib: float
    """Activations held at 1F1B's peak (in-flight micro-batches) plus the loss layer's working set."""
    mb_act_gib: float = 0.0
    """One micro-batch's activations on this stage (its blocks' and the hidden it hands on): ChunkFlow's per chunk."""
    loss_gib: float = 0.0
    """The loss layer's working set (final hidden, materialised logits), counted once."""
    kv_gib: float = 0.0
    """ChunkFlow: the K/V stores of the sequences in progress (counted in ``act_gib``)."""

    @property
    def mem_gib(self) -> float:
        return self.state_gib + self.act_gib


@dataclass
class Plan:
    name: str
    split: list[int]
    vocab_over_pp: bool
    stages: list[StageEstimate]
    num_mb: int
    emb_shares: list[float] | None = None
    """Input-embedding fraction per stage (vocab_over_pp with embedding_over_pp), else None."""
    notes: list[str] = field(default_factory=list)
    """What the activations count, one line each (ChunkFlow's estimate)."""

    @property
    def max_flops(self) -> float:
        return max(s.flops for s in self.stages)

    @property
    def step_flops(self) -> float:
        """Pipeline step ≈ (micro-batches + stages − 1) slots of the slowest stage (fill/drain ignored)."""
        return (self.num_mb + len(self.stages) - 1) * self.max_flops


def _vocab(cfg: Config, vocab: int | None) -> int:
    v = cfg.model.vocab_size or vocab
    if not v:
        raise ConfigError("megasparse plan needs model.vocab_size (set it, or pass --vocab N)")
    return v


def _padded_vocab(cfg: Config, vocab: int | None, shards: int) -> int:
    mult = cfg.model.make_vocab_divisible_by * shards
    return -(-_vocab(cfg, vocab) // mult) * mult


def estimate(
    cfg: Config,
    split: list[int],
    vocab_over_pp: bool,
    vocab: int | None = None,
    dp: int = 1,
    emb_shares: list[float] | None = None,
) -> Plan:
    """Per-stage FLOPs and memory of ``split`` (layers per stage) for the layout in ``cfg``.

    With vocab_over_pp and embedding_over_pp, ``emb_shares`` are the stages' fractions of the input embedding
    (None: the configured ``loss.embedding_pp_split``, else an even split)."""
    m, p = cfg.model, cfg.parallel
    pp, tp = len(split), p.tp
    shards = tp * (pp if vocab_over_pp else 1)
    v_pad = _padded_vocab(cfg, vocab, shards)
    shares = None
    if vocab_over_pp and cfg.loss.embedding_over_pp:
        shares = emb_shares or cfg.loss.embedding_pp_split or [1.0 / pp] * pp
    tokens = m.seq_length * cfg.train.micro_batch_size
    num_mb = cfg.num_microbatches(dp)
    elem = _elem(cfg)
    h = m.hidden_size
    stages = []
    for r, n in enumerate(split):
        params = n * layer_params(cfg) / tp
        flops = n * layer_flops(cfg, tokens) / tp
        # 1F1B keeps pp − r micro-batches in flight; vocab_over_pp's lock-step schedule 2(pp − 1 − r) + 1
        in_flight = min(2 * (pp - 1 - r) + 1 if vocab_over_pp else pp - r, num_mb)
        # one micro-batch: its blocks' activations and one hidden besides: a non-last stage's output (pipeline.InFlight
        # holds it until that micro-batch's backward; megatron-core frees it once sent), the last stage's final
        # norm input. The embedding's output is block 0's norm input, counted with the blocks.
        one = n * act_bytes_per_layer(cfg, tokens, elem) + tokens * h * elem / (tp if p.sequence_parallel else 1)
        act = one * in_flight
        if m.recompute == "full" and n:  # the block the backward is running again
            act += act_bytes_per_layer(cfg, tokens, elem, "none")
        parts = []
        if shares is not None:
            parts.append(f"emb{100 * shares[r]:.0f}%")
            params += v_pad * h / tp * shares[r]
            if r == 0:  # every micro-batch's input and its gradient live for the whole step
                act += 2 * num_mb * tokens * h * elem / (tp if p.sequence_parallel else 1)
        elif r == 0:
            parts.append("emb")
            params += v_pad * h / tp
        out_cols, copies, loss = 0, 0.0, 0.0
        if vocab_over_pp:
            parts.append(f"loss/{pp}")
            out_cols = v_pad // shards
        elif r == pp - 1:
            parts.append("loss")
            out_cols = v_pad // tp
        if out_cols:
            params += out_cols * h
            if _copies(cfg):  # the output weight's compute copy
                copies += out_cols * h * elem
            flops += loss_flops(cfg, tokens, out_cols)
            loss += tokens * h * elem  # the (gathered) final hidden the loss keeps for its backward
            # materialised logits (impl=materialized/mcore, or auto under its budget): [tokens, V_local] fp32 +
            # compute dtype
            if cfg.loss.resolved_impl(tokens, out_cols) in ("materialized", "mcore"):
                loss += tokens * out_cols * (4 + elem)
        state = (params * state_bytes(cfg, dp) + n * feature_bytes_per_layer(cfg) + copies) / GIB
        est = StageEstimate(n, "+".join(parts) or "-", flops, params, state, (act + loss) / GIB, one / GIB, loss / GIB)
        stages.append(est)
    name = "vocab_over_pp" if vocab_over_pp else "vocab on last stage"
    return Plan(name, list(split), vocab_over_pp, stages, num_mb, shares)


def chunks_held(order: str, pp: int, r: int, keep: int, longest_chunks: int, singles: int | None = None) -> int:
    """Chunks whose activations stage r holds at once under ChunkFlow's pipeline ``order`` (``chunkflow/schedule.py``)
    with sequences of up to ``longest_chunks`` chunks: K (``keep``; the sequence's chunks if fewer) of the long
    sequence, and the independent single chunks in flight, at most 1F1B's pp − r (``singles``: how many the step
    has; None: at least that).

    ``state_aware`` holds both at once, and no more with ``chunkflow.sequences_in_flight`` > 1: its
    table starts a forward that keeps its graph only within that budget (``schedule.held_budget``, decision 1249),
    so the next sequence's forwards take the room the single chunks leave. On the last stage every chunk's backward
    follows its forward (its output gradient is local), so a sequence's backwards run back to back once its last
    chunk is forwarded and nothing else is held beside its K. ``gpipe`` runs a long sequence alone, then the
    singles: the larger of the two. The slot tables never pass this and reach it on most stages (a rerun's graph
    lives in its backward's slot, after its sequence's kept chunks went: tests/test_chunkflow_memory.py)."""
    if order != "gpipe" and r < pp - 1:  # the state-aware table's own budget
        return held_budget(pp, r, keep, longest_chunks, pp - r if singles is None else singles)
    seq = min(keep, longest_chunks) if longest_chunks > 1 else 0
    own = pp - r if singles is None else min(pp - r, singles)
    return max(seq, own)


def sequence_chunks(cfg: Config, length: int) -> int:
    """Chunks of a sequence of ``length`` tokens (end-of-document included): ceil((length − 1) / chunk)
    (``chunkflow/plan.py``)."""
    return max(1, -(-(length - 1) // cfg.model.seq_length))


def kv_store_bytes(cfg: Config, layers: int, length: int, sequences: int = 1) -> float:
    """``sequences`` long sequences' ``chunkflow/state.py`` ``KVStore`` on a stage of ``layers`` blocks, one TP
    rank: every layer's rotated k and v over each sequence's whole chunks (n·C positions, compute dtype) and, once,
    fp32 gradient buffers of that size: a store makes them at its sequence's first backward there, and a stage ends
    one sequence's backwards before it starts the next one's (decision 1249; ``schedule.simulate`` checks it). A
    sequence of one chunk has no store."""
    m = cfg.model
    n = sequence_chunks(cfg, length)
    if n < 2:
        return 0.0
    heads = max(1, m.kv_heads // cfg.parallel.tp)
    return layers * heads * m.head_dim * n * m.seq_length * (sequences * 2 * _elem(cfg) + 2 * 4)


def tail_keys_bytes(cfg: Config, layers: int, length: int) -> float:
    """A packed last chunk's FlexAttention leaves on a stage of ``layers`` blocks, one TP rank
    (``chunkflow.pack_tails`` with flex, decision 1248): its keys and values padded to the longest sequence's n·C
    positions (compute dtype), kept from its forward to its backward, less its own C (they stand in for the chunk's
    keys/values output, a copy on the other kernels). The bias kernels keep nothing extra."""
    m = cfg.model
    n = sequence_chunks(cfg, length)
    if n < 2 or not (tails_packed(cfg) and tails_on_flex(cfg)):
        return 0.0
    heads = max(1, m.kv_heads // cfg.parallel.tp)
    return layers * heads * m.head_dim * (n - 1) * m.seq_length * 2 * _elem(cfg)


def chunkflow_estimate(
    cfg: Config, split: list[int], vocab: int | None = None, dp: int = 1, longest: int | None = None
) -> Plan:
    """Per-stage memory of ``split`` under ``chunkflow.enabled`` (decision 1247): the state as for fixed windows;
    the activations of ``chunks_held`` chunks, each one micro-batch of ``model.seq_length`` tokens (``estimate``'s
    own count); the K/V stores of the sequences in progress, sized by the ``longest`` sequence (tokens; None: one
    of K chunks, at least two: the shortest long sequence whose K chunks are all held); the inputs the earlier
    chunks keep for their rerun; with tails packed on flex, the padded keys of each in-flight sequence's last chunk
    (``tail_keys_bytes``); the loss layer's working set once. FLOPs are per chunk."""
    cf, m, p = cfg.chunkflow, cfg.model, cfg.parallel
    base = estimate(cfg, split, False, vocab, dp)
    pp, elem = len(split), _elem(cfg)
    longest = longest or max(2, cf.max_chunks_in_memory) * m.seq_length + 1
    n = sequence_chunks(cfg, longest)
    window = cf.sequences_in_flight if cf.pipeline_schedule == "state_aware" else 1
    # independent chunks a rank can hold: its sequences but the long one(s); under dp the ranks balance tokens, not
    # counts, so one rank may take all the short ones
    singles = max(0, cfg.train.global_batch_size - window) if n > 1 else cfg.train.global_batch_size
    hidden = m.seq_length * m.hidden_size * elem / p.sp_shards
    notes = []
    for r, s in enumerate(base.stages):
        held = chunks_held(cf.pipeline_schedule, pp, r, cf.max_chunks_in_memory, n, singles)
        seqs = window if r < pp - 1 else 1  # the last stage ends one sequence before it starts the next
        kv = kv_store_bytes(cfg, s.layers, longest, seqs)
        tails = seqs * tail_keys_bytes(cfg, s.layers, longest)
        rerun = seqs * (n - min(n, cf.max_chunks_in_memory)) * hidden if r else 0.0  # received inputs, kept
        s.act_gib, s.kv_gib = held * s.mb_act_gib + s.loss_gib + (kv + rerun + tails) / GIB, kv / GIB
        note = f"stage {r}: {held} chunks held x {s.mb_act_gib:.3f} + K/V store {kv / GIB:.3f}"
        note += f" + loss {s.loss_gib:.3f}" if s.loss_gib else ""
        note += f" + rerun inputs {rerun / GIB:.3f}" if rerun else ""
        notes.append(note + (f" + tail keys {tails / GIB:.3f}" if tails else "") + " GiB")
    order = cf.pipeline_schedule + (
        f", {window} sequence(s) in flight" if cf.pipeline_schedule == "state_aware" else ""
    )
    base.name = (
        f"ChunkFlow: chunks of {m.seq_length}, K={cf.max_chunks_in_memory}, longest sequence {longest} tokens "
        f"({n} chunks), {order}"
    )
    base.notes = notes
    return base


def rerun_tokens(cfg: Config, longest: int) -> int:
    """Tokens the ``longest`` sequence runs forward again: its chunks beyond K (``chunkflow/state.py``)."""
    return max(0, sequence_chunks(cfg, longest) - cfg.chunkflow.max_chunks_in_memory) * cfg.model.seq_length


MEMORY_SHARE = 0.92
"""Share of the GPU's memory above which the banner warns that the configured layout may not fit. The planner
counts what each op keeps (decision 1244; within 0.6 GiB of four H100s' first stage at seq 4096, 2026-11-27) but not
the CUDA context and NCCL's buffers (2-3.5 GiB) nor the allocator's fragmentation (up to 2 GiB): on 80 GB cards the
whole 8B at seq 8192 ran at an estimate of 72.0 GiB (dense, selective recompute) and ran out of memory at 73.2 (fp8,
selective, ``train.fp8_keep_transpose=false``); under ChunkFlow it ran at 71.7 and ran out of memory at 76.8
(2026-11-28)."""


@dataclass
class ChunkChoice:
    """A chunk size and K that ``chunkflow_choices`` found to fit: its estimate and the longest sequence's rerun."""

    chunk: int
    keep: int
    mem_gib: float
    rerun_tokens: int


def chunkflow_choices(
    cfg: Config, split: list[int], vocab: int | None, dp: int, longest: int, budget_gib: float
) -> list[ChunkChoice]:
    """Per chunk size, the configured one and its half (one halving only: smaller chunks cost per slot, 5% from 8192
    to 4096 on the whole 8B, four H100s, 2026-11-28), the largest K whose ``chunkflow_estimate`` fits ``budget_gib``;
    fewest rerun tokens of the ``longest`` sequence ((chunks − K) x chunk) first, then the larger chunk. There, chunks
    of 4096 at K = 5 (71.7 GiB, 12288 tokens rerun) fit where 8192 at K = 2 (76.8, 16384) did not."""
    from dataclasses import replace

    c0, tp = cfg.model.seq_length, cfg.parallel.tp
    sizes = [c for c in ((c0, c0 // 2) if c0 % 2 == 0 else (c0,)) if not (cfg.parallel.sequence_parallel and c % tp)]
    choices = []
    for chunk in sizes:
        model = replace(cfg.model, seq_length=chunk)
        best = None
        for keep in range(1, sequence_chunks(replace(cfg, model=model), longest) + 1):
            cf = replace(cfg.chunkflow, max_chunks_in_memory=keep, chunk_size=None)
            trial = replace(cfg, model=model, chunkflow=cf)
            mem = max(st.mem_gib for st in chunkflow_estimate(trial, split, vocab, dp, longest).stages)
            if mem > budget_gib:  # memory grows with K
                break
            best = ChunkChoice(chunk, keep, mem, rerun_tokens(trial, longest))
        if best is not None:
            choices.append(best)
    return sorted(choices, key=lambda c: (c.rerun_tokens, -c.chunk))


def embedding_shares(cfg: Config, split: list[int], vocab: int | None = None, dp: int = 1) -> list[float]:
    """Input-embedding fraction per stage under vocab_over_pp: the configured one, else water-filling.

    The embedding's weights and optimizer state are the one large memory item with (almost) no compute, so the
    stages with the least estimated memory without it take it until their estimates are level."""
    pp = len(split)
    if cfg.loss.embedding_pp_split is not None:
        return list(cfg.loss.embedding_pp_split)
    base = [s.mem_gib for s in estimate(cfg, split, True, vocab, dp, emb_shares=[0.0] * pp).stages]
    tp = cfg.parallel.tp
    total = _padded_vocab(cfg, vocab, tp * pp) * cfg.model.hidden_size / tp * state_bytes(cfg, dp) / GIB
    lo, hi = min(base), max(base) + total
    for _ in range(100):  # bisect the water level: sum of max(0, level - base) == total
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(max(0.0, mid - b) for b in base) < total else (lo, mid)
    fill = [max(0.0, hi - b) for b in base]
    return [f / sum(fill) for f in fill]


def best_split(cfg: Config, vocab_over_pp: bool, vocab: int | None = None, dp: int = 1) -> list[int]:
    """Contiguous split minimising (largest stage FLOPs, then largest stage memory); exact DP over layer counts."""
    layers, pp = cfg.model.num_layers, cfg.parallel.pp

    def key(split: list[int]) -> tuple[float, float]:
        plan = estimate(cfg, split, vocab_over_pp, vocab, dp)
        return plan.max_flops, max(s.mem_gib for s in plan.stages)

    # Stage r's cost depends only on r and its layer count, so best[r][used] = best prefix of r+1 stages.
    def stage_cost(r: int, n: int) -> tuple[float, float]:
        probe = [1] * pp
        probe[r] = n
        s = estimate(cfg, probe, vocab_over_pp, vocab, dp).stages[r]
        return s.flops, s.mem_gib

    cost = {(r, n): stage_cost(r, n) for r in range(pp) for n in range(1, layers - pp + 2)}
    best: dict[tuple[int, int], tuple[tuple[float, float], list[int]]] = {}
    for used in range(1, layers - pp + 2):
        best[(0, used)] = (cost[(0, used)], [used])
    for r in range(1, pp):
        for used in range(r + 1, layers - (pp - r - 1) + 1):
            cands = []
            for n in range(1, used - r + 1):
                prev = best.get((r - 1, used - n))
                if prev is None:
                    continue
                c = cost[(r, n)]
                cands.append(((max(prev[0][0], c[0]), max(prev[0][1], c[1])), prev[1] + [n]))
            best[(r, used)] = min(cands, key=lambda x: x[0])
    split = best[(pp - 1, layers)][1]
    even = even_split(layers, pp)
    if key(even) <= key(split):
        return even  # prefer the default when it is already optimal
    return split


def even_split(layers: int, pp: int) -> list[int]:
    base, rem = divmod(layers, pp)
    return [base + (1 if i < rem else 0) for i in range(pp)]


def configured_split(cfg: Config) -> list[int]:
    """The layers per stage the config names, else (null or ``auto``) the even split."""
    p = cfg.parallel
    return list(p.layer_split) if isinstance(p.layer_split, list) else even_split(cfg.model.num_layers, p.pp)


def against_even(cfg: Config, split: list[int], vocab: int | None = None, dp: int = 1) -> AutoSplit:
    """``split`` against the even split, both with the run's vocabulary placement (``loss.vocab_over_pp``, its
    embedding shares as the run would build them): the estimated share of the step saved and the fullest stage's
    memory change."""
    vop = cfg.loss.vocab_over_pp
    even = even_split(cfg.model.num_layers, cfg.parallel.pp)

    def plan(s: list[int]) -> Plan:
        shares = embedding_shares(cfg, s, vocab, dp) if vop and cfg.loss.embedding_over_pp else None
        return estimate(cfg, s, vop, vocab, dp, emb_shares=shares)

    a, b = plan(even), plan(split)
    peak = max(s.mem_gib for s in b.stages)
    return AutoSplit(list(split), even, 1 - b.step_flops / a.step_flops, peak - max(s.mem_gib for s in a.stages), peak)


def auto_split(cfg: Config, vocab: int | None = None, dp: int = 1) -> AutoSplit:
    """What ``parallel.layer_split: auto`` becomes: ``best_split`` for the run's vocabulary placement. Pure
    arithmetic on the config, the vocabulary and dp, so every rank computes the same split without talking."""
    return against_even(cfg, best_split(cfg, cfg.loss.vocab_over_pp, vocab, dp), vocab, dp)


def resolve_layer_split(cfg: Config, vocab: int, dp: int) -> AutoSplit | None:
    """Replace ``parallel.layer_split: auto`` in ``cfg`` by the planner's list (once: afterwards it is a list, which
    dumped configs record) and keep the choice on ``cfg.parallel.auto_split`` for the banner; None when not auto."""
    p = cfg.parallel
    if p.layer_split != AUTO:
        return None
    choice = auto_split(cfg, vocab, dp)
    p.layer_split, p.auto_split = list(choice.split), choice
    return choice


def format_plan(plan: Plan, anchor: Plan | None) -> str:
    """The plan's table; ``anchor``: the plan whose pipeline step the summary compares against (None: a ChunkFlow
    estimate, whose step has as many chunks as the step's sequences make: memory only, and what it counts)."""
    lines = [f"({plan.name}) parallel.layer_split={plan.split}"]
    lines.append(
        f"{'stage':>5} {'layers':>6} {'extra':>14} {'GFLOP/mb':>10} {'params M':>9} {'w+g+adam GiB':>12} "
        f"{'act GiB':>8} {'total GiB':>9}"
    )
    for r, s in enumerate(plan.stages):
        lines.append(
            f"{r:>5} {s.layers:>6} {s.parts:>14} {s.flops / 1e9:>10.2f} {s.params / 1e6:>9.2f} {s.state_gib:>12.3f} "
            f"{s.act_gib:>8.3f} {s.mem_gib:>9.3f}"
        )
    peak = max(s.mem_gib for s in plan.stages)
    if anchor is None:
        return "\n".join([*lines, *(f"  {n}" for n in plan.notes), f"peak memory {peak:.3f} GiB"])
    lines.append(
        f"max stage {plan.max_flops / 1e9:.2f} GFLOP/mb, pipeline step ≈ {plan.step_flops / 1e9:.1f} GFLOP-slots "
        f"({plan.step_flops / anchor.step_flops:.3f}x of (a)), peak memory {peak:.3f} GiB"
    )
    return "\n".join(lines)


def plans(cfg: Config, vocab: int | None = None, dp: int = 1) -> tuple[Plan, Plan, Plan]:
    """(a) configured/even split with the vocabulary on the last stage, (b) its best split, (c) vocab_over_pp."""
    p = cfg.parallel
    a = estimate(cfg, configured_split(cfg), False, vocab, dp)
    a.name = f"a: {'even' if p.layer_split == AUTO else 'configured'} split, vocabulary on the last stage"
    b = estimate(cfg, best_split(cfg, False, vocab, dp), False, vocab, dp)
    b.name = "b: recommended split, vocabulary on the last stage"
    c_split = best_split(cfg, True, vocab, dp)
    c = estimate(cfg, c_split, True, vocab, dp, emb_shares=embedding_shares(cfg, c_split, vocab, dp))
    c.name = "c: loss.vocab_over_pp=true, its best split"
    return a, b, c


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="megasparse plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?", help="YAML config; omitted: built-in defaults")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.pp=4 model.vocab_size=128000")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel size (sets micro-batches per step)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size when model.vocab_size is null")
    ap.add_argument("--longest", type=int, default=None, help="chunkflow.enabled: the data's longest sequence (tokens)")
    ap.add_argument(
        "--gpu-gib",
        type=float,
        default=None,
        help="chunkflow.enabled: GPU memory; print the chunk sizes and K that fit",
    )
    a = parse_with_overrides(ap, list(sys.argv[1:] if argv is None else argv))
    path, overrides = a.config, list(a.overrides)
    if path is not None and "=" in path and not path.endswith((".yaml", ".yml")):
        path, overrides = None, [path] + overrides
    try:
        cfg = load_config(path, overrides)
        cfg.validate(cfg.parallel.tp * cfg.parallel.pp * a.dp, devices=False)  # no CUDA needed: it is arithmetic
        if cfg.parallel.virtual_stages > 1:
            raise ConfigError("megasparse plan models plain 1F1B stages; plan with parallel.virtual_stages=1")
        if cfg.chunkflow.enabled:
            return _chunkflow_main(cfg, a.vocab, a.dp, a.longest, a.gpu_gib)
        pa, pb, pc = plans(cfg, a.vocab, a.dp)
    except ConfigError as e:
        print(f"megasparse: error: {e}", file=sys.stderr)
        return 2
    m, p = cfg.model, cfg.parallel
    print(
        f"megasparse plan: {m.num_layers} layers, hidden {m.hidden_size}, vocab {_vocab(cfg, a.vocab)}, "
        f"seq {m.seq_length} x micro-batch {cfg.train.micro_batch_size}, tp {p.tp} x pp {p.pp} x dp {a.dp}, "
        f"{pa.num_mb} micro-batches, loss.impl={cfg.loss.impl} (per TP rank, per micro-batch)"
    )
    for plan in (pa, pb, pc):
        print()
        print(format_plan(plan, pa))
    print()
    print(f"recommended: parallel.layer_split={pb.split}  (or loss.vocab_over_pp=true parallel.layer_split={pc.split})")
    if cfg.parallel.layer_split == AUTO:
        choice = auto_split(cfg, a.vocab, a.dp)
        print(f"parallel.layer_split=auto resolves to {choice.split} here ({choice.describe()})")
    if pc.emb_shares is not None:
        print(f"with vocab_over_pp the input embedding is split {[round(x, 3) for x in pc.emb_shares]} over the stages "
              "(loss.embedding_pp_split; null = this planner's memory balance)")  # fmt: skip
    return 0


def _chunkflow_main(cfg: Config, vocab: int | None, dp: int, longest: int | None, gpu_gib: float | None) -> int:
    """``megasparse plan`` under ``chunkflow.enabled``: the configured (or even) split's ChunkFlow estimate, and the
    fixed windows' peak beside it; with ``gpu_gib`` and a known longest sequence, the chunk sizes and K that fit
    ``MEMORY_SHARE`` of it (``chunkflow_choices``)."""
    from megasparse.chunkflow.config import known_longest, sequence_limit

    p, cf = cfg.parallel, cfg.chunkflow
    split = configured_split(cfg)
    limit = sequence_limit(cfg)  # the run truncates longer documents to it (data/sequences.py), as the banner counts
    longest = min(longest, limit or longest) if longest else known_longest(cfg)
    plan = chunkflow_estimate(cfg, split, vocab, dp, longest)
    fixed = max(s.mem_gib for s in estimate(cfg, split, False, vocab, dp).stages)
    print(
        f"megasparse plan: {cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}, vocab {_vocab(cfg, vocab)}, "
        f"ChunkFlow chunks of {cfg.model.seq_length}, tp {p.tp} x pp {p.pp} x dp {dp}, loss.impl={cfg.loss.impl} "
        "(per TP rank; GFLOP per chunk)"
    )
    print()
    print(format_plan(plan, None))
    if longest is None:
        print(
            f"the longest sequence is not known from the config: assumed {max(2, cf.max_chunks_in_memory)} chunks; "
            "pass --longest N (the data's longest, tokens) or set chunkflow.max_sequence_length"
        )
    print(f"fixed windows of {cfg.model.seq_length} tokens (1F1B, chunkflow.enabled=false): peak {fixed:.3f} GiB")
    if gpu_gib is not None and longest is not None:
        budget = MEMORY_SHARE * gpu_gib
        fits = chunkflow_choices(cfg, split, vocab, dp, longest, budget)
        print(f"fit {budget:.1f} GiB ({MEMORY_SHARE:.0%} of {gpu_gib:g}; fewest reruns of the longest sequence first):")
        for c in fits:
            print(f"  model.seq_length={c.chunk} chunkflow.max_chunks_in_memory={c.keep}: est. {c.mem_gib:.1f} GiB, "
                  f"{c.rerun_tokens} tokens rerun")  # fmt: skip
        if not fits:
            print("  none at this chunk size or its half, even at K=1: a smaller chunk, or more model-parallel ranks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
