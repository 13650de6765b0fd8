"""megatron-core's own GPTModel as the trainer benchmark's anchor (same shapes, layout and batch as megasparse).

Local layer spec (no Transformer Engine, no apex): RMSNorm through torch, SwiGLU (gated_linear_unit + silu),
GQA, RoPE, untied embeddings, bf16 parameters with fp32 main weights and grads (megatron-core's DDP with an
fp32 grad buffer + ``get_megatron_optimizer``, torch AdamW underneath), every CUDA fusion that needs apex/TE
off. Two core attentions:

* ``local``: megatron-core's DotProductAttention (materialised [b·n, s, s] scores + torch softmax). At seq 4096
  its saved probabilities do not fit a 1B model on one GPU, so it runs with megatron-core's selective
  recompute of the core attention — what Megatron does for non-flash attention.
* ``sdpa``: the same spec with the core attention swapped for a flash-attention module (torch SDPA flash
  kernel, causal, GQA by repeating K/V as megasparse does). megatron-core has no flash path without TE, so
  this is the fair anchor; ``local`` is reported as what the stock local spec gives.

``model.recompute=full`` becomes Megatron-LM's full uniform recompute of every layer (what a long sequence that does
not fit needs there as here); ``none`` and ``selective`` leave the sdpa spec without recompute (its flash attention
keeps no scores, so megatron-core's ``core_attn`` recompute would save nothing).

``load_from_megasparse`` copies a megasparse GPTStage's weights into the model (same rank's shards), so the
benchmark can check that both compute the same losses before timing them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.nn.functional as F

from megasparse.config import Config


def _sdpa_attention_cls():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SDPAttention(DotProductAttention):
        """Causal flash attention with megatron-core's core-attention interface ([s, b, n, d] in, [s, b, n·d] out)."""

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, **_):
            s, b, nq, d = query.shape
            group = nq // key.shape[2]
            q = query.permute(1, 2, 0, 3)
            k = key.permute(1, 2, 0, 3)
            v = value.permute(1, 2, 0, 3)
            if group > 1:
                k = k.repeat_interleave(group, dim=1)
                v = v.repeat_interleave(group, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
            return out.permute(2, 0, 1, 3).reshape(s, b, nq * d)

    return SDPAttention


class SPRMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm that declares its weight sequence-parallel (megatron-core's WrappedTorchNorm refuses SP).

    Without apex/TE the local spec has no SP-capable norm; this one only adds the ``sequence_parallel``
    attribute that makes finalize_model_grads all-reduce the norm gradients over TP, as apex's would.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def _split_kwargs(cfg: Config) -> dict:
    """megasparse's 1F1B layer split as megatron-core's first/last stage sizes (its middle stages are even), so the
    anchor runs the layout it is compared with; ``{}`` for the even split. ``parallel.layer_split: auto`` must be
    resolved (``build_gpt`` does). A split megatron-core cannot take this way (uneven middle stages, or per virtual
    stage: 4gpu_8b32l_pp2v2_dp2's [7, 9, 7, 9]) leaves the anchor on its even split, with a warning."""
    p, layers = cfg.parallel, cfg.model.num_layers
    if p.pp == 1 or p.layer_split is None:
        return {}
    split = p.stage_layers(layers)
    if p.virtual_stages > 1 or len(set(split[1:-1])) > 1:
        import warnings

        warnings.warn(f"mcore anchor: parallel.layer_split={split} not expressible; even split", stacklevel=3)
        return {}
    return {"num_layers_in_first_pipeline_stage": split[0], "num_layers_in_last_pipeline_stage": split[-1]}


def transformer_config(cfg: Config, attention: str, dtype: torch.dtype = torch.bfloat16, recompute: bool = True):
    from megatron.core.transformer.transformer_config import TransformerConfig

    m, p = cfg.model, cfg.parallel
    kw = _split_kwargs(cfg)
    if m.recompute == "full":  # Megatron-LM's --recompute-granularity full --recompute-method uniform, 1 layer
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif attention == "local" and recompute:
        kw.update(recompute_granularity="selective", recompute_modules=["core_attn"])
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.kv_heads,
        ffn_hidden_size=m.ffn_size,
        kv_channels=m.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=m.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=m.init_std,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.virtual_stages if p.virtual_stages > 1 else None,
        sequence_parallel=p.sequence_parallel,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        cross_entropy_loss_fusion=False,
        attention_softmax_in_fp32=True,
        # Megatron-LM's defaults for the schedule: pipeline outputs freed once sent; with virtual stages, P2P
        # overlapped with compute instead of batched
        deallocate_pipeline_outputs=True,
        overlap_p2p_comm=p.virtual_stages > 1,
        batch_p2p_comm=p.virtual_stages == 1,
        use_cpu_initialization=not torch.cuda.is_available(),
        **kw,
    )


def build_gpt(
    cfg: Config,
    vocab_padded: int,
    attention: str = "sdpa",
    dtype: torch.dtype = torch.bfloat16,
    recompute: bool = True,
    vp_stage: int | None = None,
):
    """(model to run, the inner GPTModel, its TransformerConfig) for this rank's pipeline stage.

    Model-parallel groups must exist. ``recompute`` (local attention only): selective recompute of the
    core attention. ``vp_stage``: which of the rank's virtual stages (``parallel.virtual_stages`` > 1).
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if attention not in ("local", "sdpa"):
        raise ValueError(f"attention={attention!r}: use local or sdpa")
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.train.seed)
    from megasparse.parallel.planner import resolve_layer_split

    resolve_layer_split(cfg, vocab_padded, ps.get_data_parallel_world_size())  # the split megasparse's case builds
    tc = transformer_config(cfg, attention, dtype, recompute)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = _sdpa_attention_cls()
    if cfg.parallel.sequence_parallel:
        spec.submodules.input_layernorm = SPRMSNorm
        spec.submodules.pre_mlp_layernorm = SPRMSNorm
        p = cfg.parallel
        n_local = p.stage_layers(cfg.model.num_layers)[(vp_stage or 0) * p.pp + ps.get_pipeline_model_parallel_rank()]
        spec = TransformerBlockSubmodules(layer_specs=[spec] * n_local, layer_norm=SPRMSNorm)
    gpt = GPTModel(
        config=tc,
        transformer_layer_spec=spec,
        vocab_size=vocab_padded,
        max_sequence_length=cfg.model.seq_length,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=int(cfg.model.rope_theta),
        vp_stage=vp_stage,
    )
    if torch.cuda.is_available():  # torch norms are built on the CPU; Megatron-LM moves the model likewise
        gpt.cuda(torch.cuda.current_device())
    # As Megatron-LM does for bf16: the torch norms are built in fp32, Float16Module casts everything to bf16.
    model = Float16Module(tc, gpt) if dtype != torch.float32 else gpt
    return model, gpt, tc


@torch.no_grad()
def load_from_megasparse(gpt, stage) -> None:
    """Copy a megasparse GPTStage's (this rank's) weights into megatron-core's GPTModel of the same layout.

    Only the fused QKV differs in layout: megasparse stores [q heads | k heads | v heads] per TP shard,
    megatron-core interleaves per query group [q of group g | k_g | v_g].
    """
    cfg = stage.cfg
    d = cfg.head_dim
    if stage.first:
        gpt.embedding.word_embeddings.weight.copy_(stage.embedding.weight)
    for ml, sl in zip(gpt.decoder.layers, stage.layers, strict=True):
        nq, nkv = sl.attn.nq, sl.attn.nkv
        w = sl.attn.qkv.weight
        q, k, v = w.split([nq * d, nkv * d, nkv * d], dim=0)
        q = q.view(nkv, nq // nkv, d, -1)
        qkv = torch.cat([q, k.view(nkv, 1, d, -1), v.view(nkv, 1, d, -1)], dim=1).reshape(w.shape)
        ml.self_attention.linear_qkv.weight.copy_(qkv)
        ml.self_attention.linear_proj.weight.copy_(sl.attn.proj.weight)
        ml.input_layernorm.weight.copy_(sl.attn_norm.weight)
        ml.pre_mlp_layernorm.weight.copy_(sl.mlp_norm.weight)
        ml.mlp.linear_fc1.weight.copy_(sl.mlp.fc1.weight)
        ml.mlp.linear_fc2.weight.copy_(sl.mlp.fc2.weight)
    if stage.last:
        gpt.decoder.final_layernorm.weight.copy_(stage.final_norm.weight)
        gpt.output_layer.weight.copy_(stage.output_weight)


def token_loss(gpt, tokens: torch.Tensor) -> torch.Tensor:
    """Per-token loss [b, s] of ``tokens`` [b, s+1] (last pipeline stage; no pipeline schedule)."""
    return gpt(tokens[:, :-1].contiguous(), None, None, labels=tokens[:, 1:].contiguous())


class McoreTrainer:
    """megatron-core's training step: get_forward_backward_func() + DDP grad finalisation + its optimizer.

    The anchor mirrors megasparse's data-parallel settings as Megatron-LM wires them: with dp > 1,
    ``parallel.overlap_grad_reduce`` turns on megatron-core's overlapped bucket reduction (``no_sync`` /
    ``start_grad_sync`` handed to the schedule) and ``parallel.distributed_optimizer`` its distributed optimizer
    with overlapped parameter all-gathers; ``parallel.virtual_stages`` > 1 builds one model chunk per virtual
    stage for its interleaved 1F1B, with overlapped P2P (and aligned parameter gathers) as Megatron-LM defaults to.
    Megatron-LM's NaN check of the gradients (on by default there) is off: the anchor is, if anything, faster.
    """

    def __init__(
        self, cfg: Config, vocab_padded: int, data: Callable[[], Iterator[torch.Tensor]], num_mb: int, attention: str
    ):
        """``data()``: a fresh stream of this DP rank's micro-batches (one per model chunk)."""
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.cfg, self.num_mb = cfg, num_mb
        p = cfg.parallel
        dp = ps.get_data_parallel_world_size()
        overlap = p.overlap_grad_reduce and dp > 1
        dist_opt = p.distributed_optimizer
        v = p.virtual_stages
        ps.set_virtual_pipeline_model_parallel_world_size(v if v > 1 else None)
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=overlap,
            use_distributed_optimizer=dist_opt,
            overlap_param_gather=dist_opt and overlap,
            align_param_gather=dist_opt and overlap and v > 1,  # Megatron-LM's default with virtual stages
            bucket_size=p.grad_bucket_numel if overlap else None,
        )
        self.chunks = []
        for i in range(v):
            gpt, _, tc = build_gpt(cfg, vocab_padded, attention, vp_stage=i if v > 1 else None)
            # Megatron-LM: chunks after the first share no buckets with the overlapped parameter gather
            self.chunks.append(
                DistributedDataParallel(config=tc, ddp_config=ddp_cfg, module=gpt, disable_bucketing=i > 0)
            )
        tc = self.chunks[0].config  # the schedule reads chunk 0's config
        tc.finalize_model_grads_func = finalize_model_grads
        if overlap:  # as Megatron-LM's training loop hands them to the schedule
            one = v == 1
            tc.no_sync_func = self.chunks[0].no_sync if one else [c.no_sync for c in self.chunks]
            tc.grad_sync_func = self.chunks[0].start_grad_sync if one else [c.start_grad_sync for c in self.chunks]
        if ddp_cfg.align_param_gather:
            tc.param_sync_func = [c.start_param_sync for c in self.chunks]
        # one data stream per chunk (the interleaved schedule draws a micro-batch per chunk and forward)
        self.data = data() if v == 1 else [data() for _ in range(v)]
        o = cfg.optim
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=o.lr,
                min_lr=o.min_lr,
                weight_decay=o.weight_decay,
                adam_beta1=o.beta1,
                adam_beta2=o.beta2,
                adam_eps=o.eps,
                clip_grad=o.grad_clip,
                bf16=True,
                params_dtype=torch.bfloat16,
                use_distributed_optimizer=dist_opt,
            ),
            self.chunks,
        )

    def _forward_step(self, data_iterator, model):
        tokens = next(data_iterator)
        out = model(tokens[:, :-1].contiguous(), None, None, labels=tokens[:, 1:].contiguous())

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"lm loss": loss.detach().clone()}  # the schedule divides ``loss`` in place

        return out, partial(loss_func)

    def train_step(self) -> tuple[float | None, float]:
        """(mean loss on the last stage or None, seconds), synchronised."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for c in self.chunks:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        m = self.cfg.model
        losses = get_forward_backward_func()(
            forward_step_func=self._forward_step,
            data_iterator=self.data,
            model=self.chunks,
            num_microbatches=self.num_mb,
            seq_length=m.seq_length,
            micro_batch_size=self.cfg.train.micro_batch_size,
            decoder_seq_length=m.seq_length,
            forward_only=False,
        )
        self.optimizer.step()
        loss = torch.stack([x["lm loss"] for x in losses]).mean().item() if losses else None
        torch.cuda.synchronize()
        return loss, time.perf_counter() - t0


def reset_memory_buffer() -> None:
    """Drop megatron-core's global memory buffer (local attention's score buffer) between benchmark cases."""
    from megatron.core import parallel_state as ps

    ps.destroy_global_memory_buffer()
    ps._set_global_memory_buffer()
