"""The trainer's step parts built from the config: the components, the stage's transfers and the step itself.

Kept out of ``train.py`` so the trainer reads as a composer (its build order stays: model → components → CUDA-graph
executor → gradient buckets and optimizer → 2:4 conversion → transfers → step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megasparse.banner import RunFacts
from megasparse.chunkflow.config import ChunkFlowConfig
from megasparse.chunkflow.data import longest_sequence
from megasparse.configbase import ConfigError
from megasparse.filtering.component import TokenFilter
from megasparse.fp8.converter import Fp8Converter, fp8_from_config
from megasparse.loss.pipeline import VocabOverPP
from megasparse.parallel.dist_optim import DistributedAdamW
from megasparse.parallel.pipeline import P2PSpec, StageComm
from megasparse.parallel.state import log0
from megasparse.sparse24.converter import Sparse24Converter

__all__ = ["Components", "build_components", "components_for_capture_check", "init_weights", "run_facts", "stage_comm"]


@dataclass
class Components:
    """The features that plug into the step; each is None where its config turns it off."""

    filter: TokenFilter | None
    """Token filtering: selection, the loss function that fills the kept rows, the static kept count."""
    sparsity: Sparse24Converter | None
    """2:4 FFNs: converts after the optimizer is built; optimizer hooks; graph operands (``prepare_replay``)."""
    vocab_pp: VocabOverPP | None
    """The vocabulary over the pipeline: embedded inputs, the loss slices' lock-step slots, the embedding backward."""
    sharded_optimizer: type[DistributedAdamW] | None
    """The distributed optimizer's class (built later, with the buckets): it only answers ``capture_blocker``."""
    fp8: Fp8Converter | None = None
    """``train.fp8``: fp8 GEMMs on the block linears (on W ⊙ M under 2:4); copies remade after each step."""
    eod: int | None = None
    """``data.document_attention``: the end-of-document id of the training data (None: attention spans the window)."""
    doc_kernel: str = "bias"
    """``data.document_attention_kernel``: the kernel the step's ``DocSpans`` ask for (decision 1201)."""
    chunkflow: ChunkFlowConfig | None = None
    """``chunkflow.enabled``: only its ``capture_blocker`` (the trainer builds the step itself, ``chunk_step``)."""

    def for_capture(self) -> list:
        """In the order ``cudagraph.capture_blocker`` asks them (the first reason is the one logged)."""
        return [self.filter, self.sparsity, self.vocab_pp, self.sharded_optimizer, self.fp8, self.chunkflow]

    def convert(self, cfg, model: torch.nn.Module, device: torch.device) -> Fp8Converter | None:
        """After the optimizer is built: the 2:4 FFNs, then fp8 over every linear (its banner line on rank 0)."""
        if self.sparsity is not None:
            self.sparsity.convert(model)
        if self.fp8 is not None:
            self.fp8.convert(model)
            log0(self.fp8.banner(device))
        return self.fp8

    @property
    def reads_weights_after_step(self) -> bool:
        """Whether a hook reads whole weights after the optimizer step (a sharded step must gather them first)."""
        return self.sparsity is not None or self.fp8 is not None

    def pre_optimizer_step(self, optimizer) -> None:
        if self.sparsity is not None:
            self.sparsity.pre_optimizer_step(optimizer)

    def post_optimizer_step(self, step: int) -> dict:
        """The 2:4 masks' decay / refresh (its metrics returned), then the fp8 weight copies."""
        extra = {} if self.sparsity is None else self.sparsity.post_optimizer_step(step)
        if self.fp8 is not None:
            self.fp8.post_optimizer_step()
        return extra


def build_components(cfg, model, train_ds, vocab: int, device: torch.device, dtype: torch.dtype, last: bool):
    """This rank's components for ``model`` (its stage); ``last``: whether it is the last pipeline stage."""
    tf = TokenFilter.from_config(cfg, train_ds, vocab, device, dtype, last)  # None: mode off
    sparsity = Sparse24Converter(cfg.sparsity, cfg.train.steps, dtype) if cfg.sparsity.enabled else None
    vocab_pp = None
    if model.vocab_pp:
        rows = cfg.model.seq_length * cfg.train.micro_batch_size
        kept = tf.kept_rows if tf is not None and tf.collider else None
        vocab_pp = VocabOverPP(model, cfg.loss, vocab=vocab, rows=rows, dtype=dtype, kept_rows=kept)
    sharded = DistributedAdamW if cfg.parallel.distributed_optimizer else None
    eod, kernel = document_eod(cfg, train_ds), cfg.data.document_attention_kernel
    return Components(tf, sparsity, vocab_pp, sharded, fp8_from_config(cfg), eod, kernel, chunkflow=_chunkflow(cfg))


def document_eod(cfg, train_ds) -> int | None:
    """The EOD id that ends the training data's documents when ``data.document_attention`` is on (else None)."""
    if not cfg.data.document_attention:
        return None
    eod = getattr(train_ds, "eod_id", None)
    if eod is None:
        raise ConfigError(f"data.document_attention: the training data ({cfg.data.prefix}) has no end-of-document id")
    return int(eod)


def _chunkflow(cfg) -> ChunkFlowConfig | None:
    return cfg.chunkflow if cfg.chunkflow.enabled else None


def init_weights(cfg, model: torch.nn.Module, vocab: int) -> None:
    """``checkpoint.init_from``: other weights (a Hugging Face model) at step 0, before buckets and masks read them."""
    if cfg.checkpoint.init_from:
        from megasparse.hf.convert import init_from  # loaded only by a run that imports weights

        init_from(cfg.checkpoint.init_from, model, cfg.model, vocab)


def run_facts(trainer) -> RunFacts:
    """What the start banner reports about a built ``train.Trainer`` (world, batch split, optimizer, graphs)."""
    t = trainer
    world = dist.get_world_size() if dist.is_initialized() else 1
    kept = None if t.filter is None else t.filter.kept_rows
    opt, cf = t.dp_opt, t.chunkflow
    return RunFacts(
        world, t.dp, t.vocab, t.vocab_padded, t.device, t.compute_dtype, t.num_mb, kept,
        opt.state_bytes() / 2**20, opt.sharded, t.graphs.blocker,
        None if cf is None else longest_sequence(cf.source, cf.max_length),
    )  # fmt: skip


def components_for_capture_check(cfg) -> list:
    """The run's components as the trainer hands them to ``cudagraph.capture_blocker``, from the config alone (no
    data, model or device): the filter without its reference source, the 2:4 converter before it converts, the
    vocabulary-over-PP and distributed-optimizer classes (their reasons need no instance)."""
    sparsity = Sparse24Converter(cfg.sparsity, cfg.train.steps, torch.float32) if cfg.sparsity.enabled else None
    vocab_pp = VocabOverPP if cfg.loss.vocab_over_pp and cfg.parallel.pp > 1 else None
    sharded = DistributedAdamW if cfg.parallel.distributed_optimizer else None
    parts = Components(
        TokenFilter.for_capture_check(cfg), sparsity, vocab_pp, sharded, fp8_from_config(cfg), chunkflow=_chunkflow(cfg)
    )
    return parts.for_capture()


def stage_comm(cfg, token_filter: TokenFilter | None, device: torch.device, dtype: torch.dtype) -> StageComm:
    """This stage's P2P transfers: activations [s(/sp), b, h]; compact gradients of the static kept count under
    collider, with what the selection fixes by shape so receivers post the rows without waiting."""
    m, b = cfg.model, cfg.train.micro_batch_size
    act_shape = (m.seq_length // cfg.parallel.sp_shards, b, m.hidden_size)
    kept = token_filter.kept_rows if token_filter is not None and token_filter.collider else None
    spec = P2PSpec(act_shape, dtype, device, None if kept is None else (lambda: kept), b)
    if kept is not None:
        spec.seq_count, spec.shards = token_filter.seq_count, token_filter.shards
    return StageComm(spec, cfg.parallel.virtual_stages)  # virtual stages > 1: the interleaved schedule's ring
