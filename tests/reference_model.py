"""A plain single-process PyTorch Llama, written independently of megasparse's ops, for exactness tests.

With ``keep`` given it implements Collider semantics explicitly, with autograd: filtered tokens are
stop-gradient in every layer — in attention their keys, values and the score columns they own are
detached, so gradients flow only among kept tokens — and the loss is the masked loss over kept tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, dim, theta):
    """x [s, b, heads, d], rotate-half RoPE at positions 0..s-1."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    ang = torch.outer(torch.arange(x.shape[0], dtype=torch.float64), inv)[:, None, None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x.chunk(2, -1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def per_token_loss(
    params: dict, cfg, vocab: int, ids: torch.Tensor, targets: torch.Tensor, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """ids/targets [s, b]; keep bool [s, b] or None (dense). Returns per-token loss [s, b]."""
    s, b = ids.shape
    nq, nkv, d = cfg.num_attention_heads, cfg.kv_heads, cfg.head_dim
    x = params["embedding.weight"][ids]  # [s, b, h]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    for layer in range(cfg.num_layers):

        def p(n: str, layer: int = layer) -> torch.Tensor:
            return params[f"layers.{layer}.{n}"]

        a = rms(x, p("attn_norm.weight"), cfg.norm_eps)
        qkv = a @ p("attn.qkv.weight").t()
        q, k, v = qkv.split([nq * d, nkv * d, nkv * d], -1)
        q = rope(q.view(s, b, nq, d), d, cfg.rope_theta)
        k = rope(k.view(s, b, nkv, d), d, cfg.rope_theta)
        v = v.view(s, b, nkv, d)
        if keep is not None:
            kk = keep[:, :, None, None]
            k = torch.where(kk, k, k.detach())
            v = torch.where(kk, v, v.detach())
        g = nq // nkv
        k = k.repeat_interleave(g, dim=2)
        v = v.repeat_interleave(g, dim=2)
        scores = torch.einsum("ibhd,jbhd->bhij", q, k) * d**-0.5  # [b, nq, s(q), s(k)]
        if keep is not None:
            col = keep.t()[:, None, None, :]  # key columns
            scores = torch.where(col, scores, scores.detach())
        scores = scores.masked_fill(~causal, float("-inf"))
        o = torch.einsum("bhij,jbhd->ibhd", scores.softmax(-1), v).reshape(s, b, nq * d)
        x = x + o @ p("attn.proj.weight").t()
        m = rms(x, p("mlp_norm.weight"), cfg.norm_eps)
        gate, up = (m @ p("mlp.fc1.weight").t()).chunk(2, -1)
        x = x + (F.silu(gate) * up) @ p("mlp.fc2.weight").t()
    x = rms(x, params["final_norm.weight"], cfg.norm_eps)
    logits = (x @ params["output_weight"].t())[..., :vocab]
    return F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), reduction="none").view(s, b)
