"""Token filtering as a trainer component: kept count, selection, reference source and the keep wiring.

The trainer calls it at two points of a micro-batch on the last pipeline stage:

    tf = TokenFilter.from_config(cfg, train_ds, ...)      # None when filter.mode=off
    spec = P2PSpec(..., kept_rows=tf.kept_rows)           # static: compact buffers sized ahead
    keep = KeepHolder(); out = model(x, batch.targets, keep)
    loss = tf.masked_loss(out, batch, keep, step, mb)     # select, tell the loss layer the kept rows, mask

Reference losses are aligned with the tokens through the :class:`~megasparse.data.batch.Batch` the trainer reads:
a sidecar is gathered at the labels' ``.bin`` offsets, the n-gram model scores the tokens, a reference model
runs on them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megasparse.config import Config
from megasparse.configbase import ConfigError
from megasparse.data.batch import Batch
from megasparse.filtering.config import FilterConfig
from megasparse.filtering.selection import KeepMask, kept_total, score_tokens, select_tokens, static_counts
from megasparse.ops.compact import KeepHolder, KeepMeta
from megasparse.ops.documents import DocSpans

__all__ = ["TokenFilter", "build_reference"]

Reference = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""``(ids [s, b], labels [s, b], label .bin offsets [s, b] | None) -> reference losses [s, b]``."""


class TokenFilter:
    """Selects the kept tokens of each micro-batch; identical on every TP rank (same losses, deterministic ties)."""

    def __init__(
        self,
        cfg: FilterConfig,
        *,
        seq_length: int,
        micro_batch_size: int,
        sp_size: int = 1,
        seed: int = 0,
        reference: Reference | None = None,
        reference_on_host: bool = True,
    ) -> None:
        self.cfg, self.sp_size, self.seed = cfg, sp_size, seed
        self.reference, self.reference_on_host = reference, reference_on_host
        self.collider = cfg.mode == "collider"
        self.kept_rows = kept_total((seq_length, micro_batch_size), cfg.keep_ratio, cfg.granularity, sp_size)
        """Kept tokens per micro-batch: static, so compact P2P buffers are sized ahead (no shape exchange)."""
        shape = (seq_length, micro_batch_size)
        self.seq_count, self.shards = static_counts(shape, cfg.keep_ratio, cfg.granularity, sp_size)
        """What the granularity fixes by shape (KeepMeta.seq_count / shards): the compact path needs no host sync."""
        self.micro_batch_size = micro_batch_size
        self.observer: Callable[[Batch, KeepMask], None] | None = None
        """Optional callback after every selection (studies: which tokens were kept)."""

    @classmethod
    def for_capture_check(cls, cfg: Config) -> TokenFilter | None:
        """The run's filter without its reference source (None: mode off): enough to ask ``capture_blocker``."""
        if cfg.filter.mode == "off":
            return None
        m, sp = cfg.model, cfg.parallel.sp_shards
        return cls(cfg.filter, seq_length=m.seq_length, micro_batch_size=cfg.train.micro_batch_size, sp_size=sp)

    def capture_blocker(self) -> str | None:
        """Why a CUDA graph cannot capture this filter's selection (None: it can); ``cudagraph`` asks."""
        f = self.cfg
        if self.collider:
            if self.seq_count is None and self.micro_batch_size > 1:
                return (
                    f"filter.granularity={f.granularity} at micro_batch_size > 1 (the compact attention backward "
                    "reads each sequence's kept count on the host; granularity=balanced or sequence fixes it)"
                )
            if self.shards != self.sp_size:
                return (
                    f"filter.granularity={f.granularity} under SP (each SP rank's kept count is read from the "
                    "indices on the host; granularity=balanced fixes it)"
                )
        if f.scorer == "random":
            return "filter.scorer=random draws from a generator seeded per micro-batch on the host"
        if f.scorer == "excess" and f.reference != "model":
            return f"filter.reference={f.reference} looks reference losses up on the host"
        if f.scorer == "excess":
            return "filter.reference=model runs a second model per micro-batch"
        return None

    @classmethod
    def from_config(
        cls, cfg: Config, train_ds, vocab: int, device: torch.device, compute_dtype: torch.dtype, last_stage: bool
    ) -> TokenFilter | None:
        """The run's filter (None when ``filter.mode=off``); only the last stage, which selects, gets a reference."""
        f = cfg.filter
        if f.mode == "off":
            return None
        ref = None
        if last_stage and f.scorer == "excess":
            ref = build_reference(cfg, train_ds, vocab, device=device, compute_dtype=compute_dtype)
        sp = cfg.parallel.sp_shards
        m = cfg.model
        return cls(
            f,
            seq_length=m.seq_length,
            micro_batch_size=cfg.train.micro_batch_size,
            sp_size=sp,
            seed=cfg.train.seed,
            reference=ref,
            reference_on_host=f.reference != "model",
        )

    def select(self, per_tok: torch.Tensor, batch: Batch, step: int, mb_index: int) -> KeepMask:
        """Kept tokens of one micro-batch from its per-token losses [s·b]; ``mb_index`` seeds random scores."""
        f = self.cfg
        s, b = batch.tokens.shape[1] - 1, batch.tokens.shape[0]
        loss2d = per_tok.detach().view(s, b)
        ref = gen = None
        if f.scorer == "excess":
            ids, labels = batch.ids, batch.labels
            if self.reference_on_host:
                ids, labels = ids.cpu(), labels.cpu()
            ref = self.reference(ids, labels, batch.label_positions)
        elif f.scorer == "random":
            gen = torch.Generator(device=per_tok.device)
            gen.manual_seed(self.seed * 1_000_003 + step * 10_007 + mb_index)
        scores = score_tokens(f.scorer, loss2d, ref, generator=gen)
        sel = select_tokens(scores, f.keep_ratio, f.granularity, sp_size=self.sp_size)
        if self.observer is not None:
            self.observer(batch, sel)
        return sel

    def masked_loss(
        self, per_tok: torch.Tensor, batch: Batch, keep: KeepHolder, step: int, mb_index: int
    ) -> torch.Tensor:
        """Sum of the kept tokens' losses; under collider ``keep`` tells the loss layer which rows get a backward."""
        sel = self.select(per_tok, batch, step, mb_index)
        if self.collider:
            keep.meta = KeepMeta(
                sel.idx, per_tok.numel(), batch.tokens.shape[0], seq_count=sel.seq_count, shards=sel.shards
            )
        return (per_tok * sel.loss_mask.reshape(-1)).sum()


def build_reference(
    cfg: Config, train_ds, vocab: int, *, device: torch.device, compute_dtype: torch.dtype
) -> Reference:
    """The ``filter.reference`` source: a sidecar over the training ``.bin``, an n-gram model, or a model."""
    f = cfg.filter
    if f.reference == "model":
        eod = getattr(train_ds, "eod_id", None) if cfg.data.document_attention else None
        return _reference_model(cfg, vocab, device, compute_dtype, eod)
    from megasparse.data.dataset import BlendedDataset, PackedDataset
    from megasparse.filtering.reference import ReferenceLosses

    prefix: str | list[str] | None = None  # the .bin files the sidecar(s) must belong to
    if isinstance(train_ds, PackedDataset):
        prefix = train_ds.indexed.prefix
    elif isinstance(train_ds, BlendedDataset):
        prefix = train_ds.prefixes
    if f.reference == "sidecar" and cfg.data.ref_losses and prefix is None:
        raise ConfigError(
            f"filter.reference=sidecar reads data.ref_losses at .bin offsets, but data.prefix={cfg.data.prefix} has "
            "none; use an indexed dataset or filter.reference=ngram"
        )
    return ReferenceLosses.from_config(f, cfg.data.ref_losses, prefix)


def _reference_model(
    cfg: Config, vocab: int, device: torch.device, compute_dtype: torch.dtype, eod: int | None = None
) -> Reference:
    """Same-architecture reference model run online (slowest source; for comparison with n-gram/sidecar). ``eod``:
    under ``data.document_attention`` it scores each token within its own document, as the model trains."""
    from megasparse import checkpoint as ckpt
    from megasparse.model.builder import build_model

    f = cfg.filter
    if not f.ref_checkpoint:
        raise ConfigError("filter.reference=model needs filter.ref_checkpoint (a run's out_dir or step dir)")
    ref = build_model(cfg, vocab, device=device, compute_dtype=compute_dtype, whole=True)
    ckpt.load_weights(f.ref_checkpoint, ref, ref.layout)
    ref.requires_grad_(False)

    @torch.no_grad()
    def losses(ids: torch.Tensor, labels: torch.Tensor, _positions: torch.Tensor | None = None) -> torch.Tensor:
        ids, labels = ids.to(device), labels.to(device)
        docs = None if eod is None else DocSpans.from_ids(ids, eod)
        return ref(ids.contiguous(), labels.reshape(-1), KeepHolder(), docs=docs).view(labels.shape)

    return losses
