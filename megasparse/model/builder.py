"""One place that turns a config into a model: the trainer's stage, the online reference model and the
inference model (`ref score`) are all built here, so they share device, dtype and initialisation rules. The
optimizer, its data-parallel wrapper and the LR schedule live in ``megasparse/optim.py``."""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist

from megasparse import checkpoint as ckpt
from megasparse.config import Config
from megasparse.model.gpt import GPTStage, StageChunks
from megasparse.ops.compact import KeepHolder
from megasparse.ops.documents import DocSpans
from megasparse.parallel import state

__all__ = [
    "InferenceModel",
    "build_model",
    "embedding_rows",
    "load_model_for_inference",
    "resolve_device",
    "resolve_dtype",
]


def resolve_device(cfg: Config) -> torch.device:
    """``train.device`` with ``auto`` resolved (CUDA when available, on the current device)."""
    dev = cfg.train.device
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device("cuda", torch.cuda.current_device()) if dev == "cuda" else torch.device("cpu")


def resolve_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """``train.dtype`` with ``auto`` resolved: bf16 on CUDA, fp32 on CPU."""
    dt = cfg.train.dtype
    if dt == "auto":
        dt = "bf16" if device.type == "cuda" else "fp32"
    return torch.bfloat16 if dt == "bf16" else torch.float32


def embedding_rows(cfg: Config, vocab: int) -> list[int] | None:
    """Input-embedding rows per stage under vocab_over_pp: the planner's memory-balancing split (or the
    configured loss.embedding_pp_split), in whole TP-divisible vocabulary blocks."""
    lay = state.layout()
    if not (cfg.loss.vocab_over_pp and cfg.loss.embedding_over_pp and lay.pp > 1):
        return None
    from megasparse.parallel import planner
    from megasparse.parallel.embedding_pp import stage_rows

    split = cfg.parallel.stage_layers(cfg.model.num_layers)
    shares = planner.embedding_shares(cfg, split, vocab, lay.dp)
    unit = cfg.model.make_vocab_divisible_by * lay.tp
    return stage_rows(cfg.padded_vocab(vocab), shares, unit)


def build_model(
    cfg: Config, vocab: int, *, device: torch.device, compute_dtype: torch.dtype, whole: bool = False
) -> GPTStage | StageChunks:
    """This rank's pipeline stage of ``cfg``'s model; ``whole``: every layer in one stage on this rank's TP
    group, whatever the pipeline layout (the online reference model, run by the last stage). With
    ``parallel.virtual_stages`` = v > 1, the rank's v chunks: chunk c is virtual stage c·pp + pp_rank.

    ``parallel.layer_split: auto`` is resolved here, in ``cfg``, at the first build of a stage: the first place a
    split is needed and the first where the vocabulary and dp are known (every rank computes the same split)."""
    m = cfg.model
    if not whole:
        from megasparse.parallel.planner import resolve_layer_split

        resolve_layer_split(cfg, vocab, state.layout().dp)
    whole_layout = dataclasses.replace(state.layout(), pp=1, pp_rank=0) if whole else None

    def stage(virtual_stage: int | None = None) -> GPTStage:
        return GPTStage(
            m,
            [m.num_layers] if whole else cfg.parallel.stage_layers(m.num_layers),
            vocab,
            cfg.padded_vocab(vocab),
            seed=cfg.train.seed,
            device=device,
            compute_dtype=compute_dtype,
            sequence_parallel=cfg.parallel.sequence_parallel,
            loss=cfg.loss,
            embedding_rows=None if whole else embedding_rows(cfg, vocab),
            layout=whole_layout,
            virtual_stage=virtual_stage,
        )

    v = cfg.parallel.virtual_stages
    if whole or v == 1:
        return stage()
    lay = state.layout()
    return StageChunks([stage(c * lay.pp + lay.pp_rank) for c in range(v)])


class InferenceModel(torch.nn.Module):
    """A single-stage model that scores token streams (``megasparse ref score``)."""

    def __init__(self, stage: GPTStage, eod: int | None = None):
        """``eod``: the end-of-document id when the model was trained with ``data.document_attention`` (a token's
        loss is then given its own document only, as in training); None: every window is one context."""
        super().__init__()
        self.stage, self.eod = stage, eod

    @torch.no_grad()
    def token_losses(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [s, b] -> [s, b]: out[t] is the loss of tokens[t] given tokens[:t] (of its document); out[0] = 0."""
        targets = torch.cat([tokens[1:], torch.full_like(tokens[:1], -100)])
        docs = None if self.eod is None else DocSpans.from_ids(tokens, self.eod)
        per_tok = self.stage(tokens.contiguous(), targets.reshape(-1), KeepHolder(), docs=docs).view(tokens.shape)
        return torch.cat([torch.zeros_like(per_tok[:1]), per_tok[:-1]])


def load_model_for_inference(cfg: Config, ckpt_dir: str) -> InferenceModel:
    """Build a one-process model (tp = pp = 1) and load a checkpoint saved at any layout; ``cfg`` is not changed."""
    cfg = copy.deepcopy(cfg)
    cfg.parallel.tp = cfg.parallel.pp = 1
    cfg.parallel.sequence_parallel = False
    cfg.parallel.layer_split = None
    cfg.parallel.virtual_stages = 1
    cfg.filter.mode = "off"
    cfg.validate(state.world_env()[1])
    from megasparse.data.dataset import build_data

    train_ds, _, vocab = build_data(cfg)
    eod = getattr(train_ds, "eod_id", None) if cfg.data.document_attention else None
    if not dist.is_initialized():
        state.init(1, 1, False, cfg.dist_backend())
    device = resolve_device(cfg)
    model = build_model(cfg, vocab, device=device, compute_dtype=resolve_dtype(cfg, device))
    ckpt.load_weights(ckpt_dir, model)
    model.eval()
    return InferenceModel(model, eod)
