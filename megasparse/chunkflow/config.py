"""The ``chunkflow`` config section: training on whole variable-length sequences cut into equal chunks."""

from __future__ import annotations

from dataclasses import dataclass

from megasparse.configbase import ConfigError


@dataclass
class ChunkFlowConfig:
    """ChunkFlow (decisions 1220-1222): each step's whole sequences are packed (short ones) or split
    (long ones) into chunks of ``model.seq_length`` tokens, which run as the step's micro-batches; a long
    sequence's chunks run in order, each attending to the earlier chunks' keys/values, and peak activation memory
    follows ``max_chunks_in_memory`` chunks instead of the longest sequence. The chunk size *is*
    ``model.seq_length``: every static shape of the trainer (RoPE tables, transfers, loss sizes) derives from it.
    ``train.global_batch_size`` then counts sequences per step and ``train.micro_batch_size`` must be 1. Any
    TP/SP/PP/DP layout; the step runs eagerly (no CUDA graphs)."""

    enabled: bool = False
    chunk_size: int | None = None
    """Tokens per chunk: None means ``model.seq_length``; given, it must equal ``model.seq_length`` (a chunk is the
    micro-batch window every static shape derives from, so the two cannot differ)."""
    max_chunks_in_memory: int = 2
    """K: how many chunks of one long sequence keep their activations for the backward. Earlier chunks run forward
    without them (only their keys/values are kept) and run forward again just before their backward: K = 1 costs
    about one extra forward per chunk beyond the last; K >= the chunks of the longest sequence costs none."""
    max_sequence_length: int | None = None
    """The longest sequence (tokens, end-of-document included): a corpus's longer documents are truncated to it
    (``data/sequences.py`` counts them); None: no limit, or the positions the model's RoPE scaling supports. The
    stand-in synthetic data draws its long tail up to it (None: 64 chunks)."""
    pipeline_schedule: str = "state_aware"
    """Under ``parallel.pp > 1``: ``state_aware`` (ChunkFlow's state-aware 1F1B: independent chunks fill a long
    sequence's fill and drain, decision 1226) or ``gpipe`` (each long sequence fills and drains the pipeline on its
    own, then the single chunks run 1F1B: the order before it). ``filter.mode=collider`` runs either: a sequence's
    kept positions, chosen on the last stage, cross each stage boundary with the gradient of its first backward
    (decision 1223)."""
    pack_tails: bool | None = None
    """With ``data.document_attention`` (short sequences packed): the short sequences' first-fit also fills the
    padding after a long sequence's last piece (decision 1233). Only the long sequence's rows of that chunk attend to
    its earlier chunks; the short documents attend within themselves from position 0. null (the default): on where
    that chunk runs FlexAttention (``data.document_attention_kernel`` flex, or auto on CUDA at bf16/fp16), one
    variant compiled before the first step for every prefix length (tens of seconds; decision 1248), which on the
    whole 8B lifted the fill from 87% to 99% and the real tokens/s by 5.6%; off on the bias kernels, where it ran
    10-11% slower. true/false: always/never (false: each long sequence pads its last chunk)."""
    sequences_in_flight: int = 2
    """``state_aware``: long sequences in progress on a stage at once. 2 (the default) lets the next sequence's
    forwards fill the previous one's turnaround (far fewer idle slots when long sequences outnumber the short ones)
    at the cost of a second sequence's keys/values, not of activations: its chunks share the budget of one
    sequence's K and 1F1B's single chunks, and its gradient buffers come only at its backward (decision 1249). On
    the whole 8B (chunks of 4096, K = 5) 2 ran 6% faster than 1 for +1.1 GiB. 1: one sequence at a time."""
    free_sends: bool = True
    """Under ``parallel.pp > 1``: a stage's sends go out without waiting for the receiving stage (gradients on a
    second process group), and the pipeline table is built with a backward twice a forward (decision 1249: 5-6%
    shorter in the schedule simulator at pp 2, 0.5-6% faster on the whole 8B with two sequences in flight). false:
    every boundary's transfers are one rendezvous batch and the table counts one slot per op, the order before.
    ``filter.mode=collider`` always takes the rendezvous batches (its compact gradients pair their indices and
    rows)."""

    def capture_blocker(self) -> str | None:
        """Why the step cannot be captured as CUDA graphs (``cudagraph.capture_blocker`` asks): chunks run eagerly,
        each chunk's prefix has its own length and each step its own chunk count."""
        return "chunkflow.enabled (chunks run eagerly)" if self.enabled else None

    def validate(self, cfg, dp: int) -> None:
        """Against the whole config (``cfg``: ``config.Config``), before any process group exists."""
        if not self.enabled:
            return
        if self.max_chunks_in_memory < 1:
            raise ConfigError(f"chunkflow.max_chunks_in_memory={self.max_chunks_in_memory} must be >= 1")
        if self.pipeline_schedule not in ("state_aware", "gpipe"):
            raise ConfigError(f"chunkflow.pipeline_schedule={self.pipeline_schedule!r}: use state_aware or gpipe")
        if self.sequences_in_flight < 1:
            raise ConfigError(f"chunkflow.sequences_in_flight={self.sequences_in_flight} must be >= 1")
        m, p, t = cfg.model, cfg.parallel, cfg.train
        if self.chunk_size is not None and self.chunk_size != m.seq_length:
            raise ConfigError(
                f"chunkflow.chunk_size={self.chunk_size} differs from model.seq_length={m.seq_length}: a chunk is the "
                "micro-batch window; set model.seq_length to the chunk size (or leave chunkflow.chunk_size unset)"
            )
        limit = self.max_sequence_length
        if limit is not None and limit < 2:
            raise ConfigError(f"chunkflow.max_sequence_length={limit} must be >= 2")
        supported = int(m.rope_original_max_positions * m.rope_scaling_factor)
        if m.rope_scaling == "llama3" and limit is not None and limit > supported:
            raise ConfigError(
                f"chunkflow.max_sequence_length={limit} exceeds the {supported} positions the "
                "model's RoPE scaling supports (model.rope_original_max_positions x model.rope_scaling_factor)"
            )
        if p.sequence_parallel and m.seq_length % p.tp:
            raise ConfigError(
                f"chunkflow: the chunk size model.seq_length={m.seq_length} must be a multiple of parallel.tp={p.tp} "
                "under sequence parallelism"
            )
        if t.global_batch_size < dp:
            raise ConfigError(f"chunkflow: train.global_batch_size={t.global_batch_size} sequences for dp={dp} ranks")
        if t.micro_batch_size != 1:
            raise ConfigError("chunkflow.enabled=true: a chunk is the micro-batch; set train.micro_batch_size=1")
        blocked = [
            (p.virtual_stages > 1, "parallel.virtual_stages > 1 (chunks run the plain pipeline order; set it to 1)"),
            (cfg.loss.vocab_over_pp, "loss.vocab_over_pp (a lock-step schedule; set loss.vocab_over_pp=false)"),
            (
                cfg.filter.mode != "off" and cfg.filter.scorer == "excess" and cfg.filter.reference == "model",
                "filter.reference=model (the reference model would need its own chunked prefix state across a "
                "sequence's chunks; score a sidecar with `megasparse ref score` and use filter.reference=sidecar, "
                "or use filter.reference=ngram)",
            ),
            (
                m.recompute == "full",
                "model.recompute=full (ChunkFlow recomputes whole chunks; use none or selective)",
            ),
        ]
        for bad, what in blocked:
            if bad:
                raise ConfigError(f"chunkflow.enabled=true does not combine with {what}")


def sequence_limit(cfg) -> int | None:
    """The longest sequence a run trains: ``chunkflow.max_sequence_length``, else what RoPE scaling supports."""
    m = cfg.model
    if cfg.chunkflow.max_sequence_length is not None or m.rope_scaling != "llama3":
        return cfg.chunkflow.max_sequence_length
    return int(m.rope_original_max_positions * m.rope_scaling_factor)


def known_longest(cfg) -> int | None:
    """The longest sequence the config alone fixes: ``sequence_limit``, else for ``data.prefix=synthetic`` the
    stand-in's 64 chunks (``data.LongTailSequences``); None: only the data knows (``data.longest_sequence``)."""
    limit = sequence_limit(cfg)
    if limit is None and cfg.data.prefix == "synthetic":
        return 64 * cfg.model.seq_length
    return limit


def tails_on_flex(cfg, cuda: bool = True, half: bool | None = None) -> bool:
    """Whether a packed last chunk's attention runs FlexAttention: ``data.document_attention_kernel`` flex, or auto
    on CUDA at bf16/fp16 (``half``; None: ``train.dtype`` is not fp32): ``ops/doc_flex.picks_flex``, the rule its
    ``chosen`` applies to the chunk's tensors."""
    from megasparse.ops.doc_flex import picks_flex  # torch's, only when asked: config loading stays light

    half = cfg.train.dtype != "fp32" if half is None else half
    return picks_flex(getattr(cfg.data, "document_attention_kernel", "bias"), cuda, half)


def tails_packed(cfg, cuda: bool = True, half: bool | None = None) -> bool:
    """Whether short sequences also fill long sequences' last chunks: never without ``data.document_attention``;
    ``chunkflow.pack_tails`` where set; null: where those chunks run FlexAttention (``tails_on_flex``; decision
    1248). ``cuda``/``half``: the run's device and compute precision (the planner sizes a GPU: CUDA)."""
    if not getattr(cfg.data, "document_attention", False):
        return False
    forced = cfg.chunkflow.pack_tails
    return tails_on_flex(cfg, cuda, half) if forced is None else forced


def chunkflow_line(cfg, tails: bool) -> str:
    """The start banner's line: what a step holds, what K keeps and whether short sequences share chunks
    (``tails``: ``tails_packed`` for the run's device and precision)."""
    cf, t = cfg.chunkflow, cfg.train
    limit = sequence_limit(cfg)
    packed = "one per chunk"
    if getattr(cfg.data, "document_attention", False):
        packed = "packed (document attention)" + (", also into long sequences' last chunks" if tails else "")
    line = (
        f"on: {t.global_batch_size} whole sequences/step{'' if limit is None else f' (up to {limit} tokens)'} in "
        f"chunks of {cfg.model.seq_length}, activations of K={cf.max_chunks_in_memory} chunks per sequence kept, "
        f"short sequences {packed}"
    )
    if cfg.parallel.pp > 1:
        order = cf.pipeline_schedule
        line += f" | pipeline order {order}"
        if order == "state_aware":
            line += f", {cf.sequences_in_flight} sequence(s) in flight"
        line += ", sends that never wait" if frees_sends(cfg) else ", rendezvous transfers"
    return line


def frees_sends(cfg) -> bool:
    """Whether the pipeline's sends go out without waiting (``chunkflow.free_sends``; collider's compact gradients
    always cross in rendezvous batches). The step, its table's costs and the banner ask this one place."""
    return cfg.parallel.pp > 1 and cfg.chunkflow.free_sends and cfg.filter.mode != "collider"
