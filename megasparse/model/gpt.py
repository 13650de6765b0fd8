"""Llama-style decoder, one pipeline stage at a time.

A stage holds a contiguous range of transformer blocks; the first stage also owns the
vocabulary-parallel input embedding, the last the final norm and the vocabulary-parallel output
layer. With virtual pipeline stages a rank holds several such stages (``StageChunks``), one per
chunk. Every parameter is initialised from a seed and its global name, so any TP/PP/DP layout
starts from the same full model. Activations are [s, b, h], sequence-sharded under SP.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megasparse.loss import vocab_parallel_loss
from megasparse.loss.config import LossConfig
from megasparse.loss.pipeline import slice_range, vocab_pp_loss
from megasparse.model.config import ModelConfig
from megasparse.ops import recompute
from megasparse.ops.attention import attention, rope_tables
from megasparse.ops.compact import KeepHolder
from megasparse.ops.documents import DocSpans
from megasparse.ops.rowwise import rms_norm, swiglu
from megasparse.parallel import state
from megasparse.parallel.embedding_pp import PPEmbedding
from megasparse.parallel.groups import ProcessGroups
from megasparse.parallel.layers import (
    ColumnParallelLinear,
    ComputeCopy,
    RowParallelLinear,
    VocabParallelEmbedding,
    padded_vocab_init,
)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, device, sequence_parallel: bool):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, device=device))
        # Under SP each TP rank sees a different sequence shard: the trainer sums these grads over TP.
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, seed: int, device, sp: bool, dtype, pg: ProcessGroups):
        super().__init__()
        d = cfg.head_dim
        self.nq, self.nkv = cfg.num_attention_heads // pg.tp, cfg.kv_heads // pg.tp
        self.recompute = cfg.recompute == "selective"  # rotated q/k rebuilt in the backward (decision 0012)
        self.keep_graph = cfg.recompute == "none"  # flex's graph kept fwd -> bwd (decision 1202)
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        kw = dict(seed=seed, device=device, sequence_parallel=sp, compute_dtype=dtype, pg=pg)
        parts = [cfg.num_attention_heads * d, cfg.kv_heads * d, cfg.kv_heads * d]
        self.qkv = ColumnParallelLinear(
            cfg.hidden_size, parts, name=f"layers.{layer}.attn.qkv", init_std=cfg.init_std, **kw
        )
        self.proj = RowParallelLinear(
            cfg.num_attention_heads * d, cfg.hidden_size, name=f"layers.{layer}.attn.proj", init_std=out_std, **kw
        )
        self.qkv_bias = None
        if cfg.qkv_bias:  # this rank's rows of [q; k; v], like the weight (zeros: the same at every layout)
            self.qkv_bias = nn.Parameter(torch.zeros((self.nq + 2 * self.nkv) * d, device=device))
            self.qkv_bias.tp_spec = (0, parts)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        docs: DocSpans | None = None,
        kv=None,
        layer: int = 0,
    ) -> torch.Tensor:
        """``docs``: the micro-batch's documents; ``kv``: ChunkFlow's ``chunkflow.state.ChunkKV`` (a chunk of a
        longer sequence: the earlier chunks' keys and values join, at ``layer``'s store)."""
        qkv = self.qkv(x)
        bias = None if self.qkv_bias is None else self.qkv_bias.to(qkv.dtype)
        if kv is not None:
            return self.proj(kv.attend(layer, qkv, self.nq, self.nkv, cos, sin, bias))
        return self.proj(attention(qkv, self.nq, self.nkv, cos, sin, self.recompute, bias, docs, self.keep_graph))


class SwiGLUMLP(nn.Module):
    """fc1 (column-parallel, [gate | up] chunk order per shard) → SwiGLU → fc2 (row-parallel)."""

    def __init__(self, cfg: ModelConfig, layer: int, seed: int, device, sp: bool, dtype, pg: ProcessGroups):
        super().__init__()
        f = cfg.ffn_size
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        kw = dict(seed=seed, device=device, sequence_parallel=sp, compute_dtype=dtype, pg=pg)
        self.fc1 = ColumnParallelLinear(
            cfg.hidden_size, [f, f], name=f"layers.{layer}.mlp.fc1", init_std=cfg.init_std, **kw
        )
        self.fc2 = RowParallelLinear(f, cfg.hidden_size, name=f"layers.{layer}.mlp.fc2", init_std=out_std, **kw)
        self.recompute = cfg.recompute == "selective"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        a = swiglu(h)
        if not self.recompute:
            return self.fc2(a)
        with recompute.recomputed_when_saved(a, swiglu, h):  # fc2 keeps fc1's output, not the SwiGLU's (0012)
            return self.fc2(a)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, seed: int, device, sp: bool, dtype, pg: ProcessGroups):
        super().__init__()
        self.layer = layer
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, device, sp)
        self.attn = Attention(cfg, layer, seed, device, sp, dtype, pg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, device, sp)
        self.mlp = SwiGLUMLP(cfg, layer, seed, device, sp, dtype, pg)
        self.full_recompute = cfg.recompute == "full"

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs: DocSpans | None = None, kv=None
    ) -> torch.Tensor:
        """``docs``: the micro-batch's documents (``data.document_attention``; None: one causal window); ``kv``:
        ChunkFlow's chunk state."""
        if self.full_recompute:  # only x is kept; the layer runs again in the backward (decision 0012)
            return recompute.full(self._forward, x, cos, sin, docs)  # (ChunkFlow's kv: rejected by its config)
        return self._forward(x, cos, sin, docs, kv)

    def _forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs: DocSpans | None = None, kv=None
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, docs, kv, self.layer)
        return x + self.mlp(self.mlp_norm(x))

    def ffn_linears(self) -> dict[str, nn.Module]:
        """The FFN GEMMs by weight name (what a model converter such as 2:4 sparsity replaces)."""
        return {lin.pname + ".weight": lin for lin in (self.mlp.fc1, self.mlp.fc2)}

    def linears(self) -> dict[str, nn.Module]:
        """Every GEMM of the block (qkv, proj, fc1, fc2) by weight name (what a precision converter such as fp8
        replaces)."""
        return {lin.pname + ".weight": lin for lin in (self.attn.qkv, self.attn.proj, self.mlp.fc1, self.mlp.fc2)}


class GPTStage(nn.Module):
    """The part of the decoder that lives on this pipeline rank."""

    def __init__(
        self,
        cfg: ModelConfig,
        layers_per_stage: list[int],
        vocab_size: int,
        vocab_padded: int,
        *,
        seed: int,
        device,
        compute_dtype: torch.dtype,
        sequence_parallel: bool = False,
        loss: LossConfig | None = None,
        embedding_rows: list[int] | None = None,
        layout: state.Layout | None = None,
        virtual_stage: int | None = None,
        pg: ProcessGroups | None = None,
    ):
        """``layers_per_stage``: layers of every (virtual) stage, in pipeline order. ``embedding_rows``:
        input-embedding rows per pipeline stage under embedding_over_pp (None: even). ``layout``: this stage's
        place in the grid (default: the global one); a whole-model reference on the last pipeline stage passes
        its TP place with pp=1. ``pg``: the TP group the layers talk over (default: the process's,
        ``state.groups()``); layers below read nothing else. ``virtual_stage``: which entry of ``layers_per_stage``
        this is (default: the pipeline rank; chunk c of rank r is c·pp + r)."""
        super().__init__()
        lay = self.layout = layout or state.layout()
        self.pg = pg = pg or state.groups()
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.compute_dtype = compute_dtype
        self.sp = sequence_parallel
        self.loss_cfg = loss or LossConfig()
        vs = lay.pp_rank if virtual_stage is None else virtual_stage
        self.first, self.last = vs == 0, vs == len(layers_per_stage) - 1
        start = sum(layers_per_stage[:vs])
        self.layer_ids = list(range(start, start + layers_per_stage[vs]))
        kw = dict(seed=seed, device=device, sequence_parallel=sequence_parallel, compute_dtype=compute_dtype, pg=pg)
        # loss.vocab_over_pp: every pipeline rank holds a slice of the output layer (loss/pipeline.py),
        # and with loss.embedding_over_pp a slice of the input embedding, which the trainer drives per step
        self.vocab_pp = self.loss_cfg.vocab_over_pp and lay.pp > 1
        self.embedding_pp = self.vocab_pp and self.loss_cfg.embedding_over_pp
        if self.embedding_pp:
            self.embedding = PPEmbedding(
                vocab_padded, cfg.hidden_size, init_std=cfg.init_std, seed=seed, device=device,
                vocab_size=vocab_size, sequence_parallel=sequence_parallel, compute_dtype=compute_dtype,
                rows_per_stage=embedding_rows,
            )  # fmt: skip
        elif self.first:
            self.embedding = VocabParallelEmbedding(
                vocab_padded, cfg.hidden_size, name="embedding", init_std=cfg.init_std, vocab_size=vocab_size, **kw
            )
        self.layers = nn.ModuleList(
            TransformerBlock(cfg, i, seed, device, sequence_parallel, compute_dtype, pg) for i in self.layer_ids
        )
        if self.last:
            self.final_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, device, sequence_parallel)
        self.tied = cfg.tie_embeddings and not self.vocab_pp  # (validated: no vocab_over_pp, no virtual stages)
        if self.tied and self.last and self.first:  # one parameter: the loss reads the embedding's own slice of rows
            self.__dict__["output_weight"] = self.embedding.weight  # not registered twice (one checkpoint key)
            self.vocab_start = self.embedding.vocab_start
            self.output_copy = None
        elif self.last or self.vocab_pp:
            per_rank = vocab_padded // lay.tp
            self.vocab_start = lay.tp_rank * per_rank
            if self.vocab_pp:
                self.vocab_start, per_rank = slice_range(vocab_padded)
            init = "embedding" if self.tied else "output"  # pp > 1 tied: the last stage's copy of the embedding
            full = padded_vocab_init(init, vocab_size, vocab_padded, cfg.hidden_size, cfg.init_std, seed, device)
            self.output_weight = nn.Parameter(full[self.vocab_start : self.vocab_start + per_rank].contiguous())
            self.output_weight.tp_spec = (0, [vocab_padded // (lay.pp if self.vocab_pp else 1)])
            self.output_weight.pp_vocab = self.vocab_pp
            self.output_weight.vocab_rows = (self.vocab_start, vocab_size)  # global rows (parallel/shards.py)
            # its gradient is summed with the first stage's embedding over the embedding group (parallel/tied.py)
            self.output_weight.tied_copy = self.tied
            if not self.vocab_pp:  # its compute-dtype copy, once per optimizer step (layers.ComputeCopies)
                self.output_copy: ComputeCopy | None = None
        cos, sin = rope_tables(cfg.seq_length, cfg.head_dim, cfg.rope_theta, device, scaling=cfg.rope_scaling_args)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def rope(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables covering ``positions`` (they grow, doubling, past model.seq_length: evaluation and
        generation of longer sequences)."""
        if positions > self.rope_cos.shape[0]:
            n = max(positions, 2 * self.rope_cos.shape[0])
            m = self.cfg
            self.rope_cos, self.rope_sin = rope_tables(
                n, m.head_dim, m.rope_theta, self.rope_cos.device, scaling=m.rope_scaling_args
            )
        return self.rope_cos, self.rope_sin

    def forward(
        self,
        x: torch.Tensor,
        targets: torch.Tensor | None = None,
        keep: KeepHolder | None = None,
        docs: DocSpans | None = None,
        kv=None,
    ) -> torch.Tensor:
        """First stage: x is token ids [s, b] (the embedded input under embedding_over_pp).

        Last stage returns per-token loss [s·b]; others hidden. ``docs``: the documents of the whole [s, b] window
        (``data.document_attention``: attention within documents, RoPE at positions in them). ``kv``: ChunkFlow's
        chunk of a longer sequence (``chunkflow.state.ChunkKV``): positions start at ``kv.offset``, attention sees
        the earlier chunks."""
        full = x.shape[0] * (self.layout.tp if self.sp and not (self.first and not self.embedding_pp) else 1)
        cos, sin = self.rope(full + (0 if kv is None else kv.offset))
        if self.first and not self.embedding_pp:
            x = self.embedding(x)
        for block in self.layers:
            x = block(x, cos, sin, docs, kv)
        if not self.last:
            return x
        x = self.final_norm(x)
        if self.vocab_pp:
            return vocab_pp_loss(
                x,
                self.output_weight,
                targets,
                self.loss_cfg,
                vocab_start=self.vocab_start,
                vocab_size=self.vocab_size,
                sequence_parallel=self.sp,
                keep=keep,
                operand=self.output_weight.detach().to(self.compute_dtype),  # cast per use: memory (decision 0800)
            )
        copy = self.output_copy
        operand = copy.get() if copy is not None else self.output_weight.detach().to(self.compute_dtype)
        return vocab_parallel_loss(
            x,
            self.output_weight,  # the fp32 master: the loss adds dC into its bucket slice (ops/wgrad.py)
            targets,
            self.loss_cfg,
            vocab_start=self.vocab_start,
            vocab_size=self.vocab_size,
            tp_group=self.pg.tp_group,
            sequence_parallel=self.sp,
            keep_idx=keep,
            operand=operand,
        )

    def ffn_linears(self, layers: set[int] | None = None) -> dict[str, nn.Module]:
        """FFN linears of this stage's blocks (all, or those whose global layer id is in ``layers``), by weight name."""
        out: dict[str, nn.Module] = {}
        for block in self.layers:
            if layers is None or block.layer in layers:
                out.update(block.ffn_linears())
        return out

    def linears(self) -> dict[str, nn.Module]:
        """Every block linear of this stage (qkv, proj, fc1, fc2) by weight name; not the output layer."""
        return {k: v for block in self.layers for k, v in block.linears().items()}

    def param_is_sharded(self, name: str) -> bool:
        """TP-sharded parameters differ across TP ranks; the norms are replicated."""
        return hasattr(self.get_parameter(name), "tp_spec")

    @property
    def chunks(self) -> list[GPTStage]:
        """The model chunks this rank runs, in virtual-stage order: just this stage (see ``StageChunks``)."""
        return [self]

    def global_name(self, name: str) -> str:
        """A parameter's name in the whole model: stage-local ``layers.<i>.`` becomes the global layer index."""
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            return f"layers.{self.layer_ids[int(i)]}.{rest}"
        return "embedding.weight" if self.tied and name == "output_weight" else name  # pp > 1 tied: one key


class StageChunks(nn.Module):
    """A pipeline rank's model chunks under ``parallel.virtual_stages`` > 1: chunk c is virtual stage c·pp + r.

    The trainer, optimizer, gradient reduction and checkpoints see one module whose parameters are every
    chunk's (local names ``chunks.<c>.…``); ``global_name`` maps them to the whole model's names."""

    vocab_pp = False
    """The vocabulary over the pipeline is not combined with virtual stages (rejected by the config)."""
    embedding_pp = False

    def __init__(self, chunks: list[GPTStage]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        # the whole model's shape, which checkpoints record and check (checkpoint.model_shape); bench_pp_balance
        # reads layer_ids
        self.cfg, self.vocab_size = chunks[0].cfg, chunks[0].vocab_size
        self.layer_ids = [i for c in chunks for i in c.layer_ids]

    def ffn_linears(self, layers: set[int] | None = None) -> dict[str, nn.Module]:
        """Every chunk's FFN linears (global weight names, so chunks never collide)."""
        return {k: v for c in self.chunks for k, v in c.ffn_linears(layers).items()}

    def linears(self) -> dict[str, nn.Module]:
        return {k: v for c in self.chunks for k, v in c.linears().items()}

    def param_is_sharded(self, name: str) -> bool:
        return hasattr(self.get_parameter(name), "tp_spec")

    def global_name(self, name: str) -> str:
        """``chunks.<c>.<local>`` -> chunk c's global name of ``<local>`` (the checkpoint-resharding map)."""
        _, c, rest = name.split(".", 2)
        return self.chunks[int(c)].global_name(rest)
