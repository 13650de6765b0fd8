"""Tiny random Hugging Face Llama-family models written with ``save_pretrained`` (no download), shared by the hf
tests: what each exercises is in its name."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 320
BASE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=VOCAB)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}  # fmt: skip

SPECS = {
    # GQA, untied, 4 layers (two per pipeline stage)
    "llama": ("llama", dict(num_hidden_layers=4, rope_theta=10000.0)),
    # Llama-3.1: llama3 RoPE scaling, head_dim 32 != hidden / heads
    "llama31": ("llama", dict(num_hidden_layers=2, head_dim=32, rope_theta=500000.0, rope_scaling=LLAMA3)),
    # Llama-3.2-1B style: tied embeddings and llama3 scaling
    "llama32": ("llama", dict(num_hidden_layers=2, tie_word_embeddings=True, rope_theta=500000.0, rope_scaling=LLAMA3)),
    # Qwen2: q/k/v biases (made non-zero), tied embeddings
    "qwen2": ("qwen2", dict(num_hidden_layers=2, tie_word_embeddings=True, rope_theta=1000000.0)),
}


def hf_model(name: str, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kind, extra = SPECS[name]
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**BASE, **extra, max_position_embeddings=64))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**BASE, **extra, max_position_embeddings=64))
        with torch.no_grad():
            for layer in model.model.layers:
                for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    lin.bias.normal_(0.0, 0.1)
    return model.eval()


def save_models(root: Path, names=tuple(SPECS)) -> dict[str, str]:
    """Every model of ``names`` saved under ``root``/<name> (fp32 safetensors); returns name -> directory."""
    out = {}
    for name in names:
        hf_model(name).save_pretrained(root / name)
        out[name] = str(root / name)
    return out


def hf_logits(path: str, ids: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits [b, s, vocab] of a saved directory."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits
