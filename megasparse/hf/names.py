"""Hugging Face Llama-family configs and tensor names, mapped to megasparse's model config and global tensor names.

The map is the whole of the conversion: megasparse's decoder is Llama's maths with no permutation of any weight
(``attn.qkv`` is HF's [q; k; v] rows, ``mlp.fc1`` its [gate; up] rows), so a global tensor is one HF tensor or a
row concatenation of several. Anything in a config that would change the maths and is not implemented is refused
in one line (``HFError``), never dropped.
"""

from __future__ import annotations

from megasparse.configbase import ConfigError

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM")
"""Architectures whose maths megasparse implements (Qwen2: q/k/v biases; both: optional tied embeddings)."""


class HFError(ConfigError):
    """A Hugging Face directory megasparse cannot read or convert faithfully (one line)."""


def _rope(hf: dict) -> tuple[float, dict | None]:
    """(theta, scaling dict or None) from either transformers 4's ``rope_theta``/``rope_scaling`` or 5's
    ``rope_parameters``."""
    params = hf.get("rope_parameters") or {}
    theta = float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return theta, scaling


def model_overrides(hf: dict, where: str = "config.json") -> dict:
    """``model.*`` values of the megasparse config equivalent to HF ``config.json`` ``hf`` (HFError otherwise)."""
    arch = (hf.get("architectures") or ["?"])[0]
    if arch not in SUPPORTED:
        raise HFError(f"{where}: architecture {arch} is not supported; megasparse reads {', '.join(SUPPORTED)}")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise HFError(f"{where}: hidden_act={act} is not implemented (megasparse's MLP is SwiGLU with silu)")
    if hf.get("mlp_bias"):
        raise HFError(f"{where}: mlp_bias=true (biases on the MLP) is not implemented")
    if arch == "LlamaForCausalLM" and hf.get("attention_bias"):
        raise HFError(f"{where}: attention_bias=true puts a bias on o_proj too, which is not implemented")
    if hf.get("use_sliding_window") or (arch != "Qwen2ForCausalLM" and hf.get("sliding_window")):
        raise HFError(f"{where}: sliding-window attention is not implemented (megasparse attends causally in full)")
    theta, scaling = _rope(hf)
    heads = hf["num_attention_heads"]
    out = {
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "num_attention_heads": heads,
        "num_query_groups": hf.get("num_key_value_heads") or heads,
        "ffn_hidden_size": hf["intermediate_size"],
        "vocab_size": hf["vocab_size"],
        "rope_theta": theta,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "init_std": float(hf.get("initializer_range", 0.02)),
        "seq_length": min(int(hf.get("max_position_embeddings") or 2048), 2048),
        "qkv_bias": arch == "Qwen2ForCausalLM",
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }
    head_dim = hf.get("head_dim")
    if head_dim and head_dim * heads != hf["hidden_size"]:
        out["kv_channels"] = head_dim
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3":
            raise HFError(f"{where}: RoPE scaling type {kind!r} is not implemented; megasparse implements llama3")
        out.update(
            rope_scaling="llama3",
            rope_scaling_factor=float(scaling["factor"]),
            rope_low_freq_factor=float(scaling["low_freq_factor"]),
            rope_high_freq_factor=float(scaling["high_freq_factor"]),
            rope_original_max_positions=int(scaling["original_max_position_embeddings"]),
        )
    return out


def hf_config(m, vocab: int, dtype: str) -> dict:
    """``config.json`` for megasparse model config ``m`` (a ``ModelConfig``) with ``vocab`` rows."""
    qwen = m.qkv_bias
    cfg = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max(m.seq_length, m.rope_original_max_positions if m.rope_scaling_args else 0),
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "tie_word_embeddings": m.tie_embeddings,
        "vocab_size": vocab,
        "initializer_range": m.init_std,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if not qwen:
        cfg.update(attention_bias=False, mlp_bias=False)
    else:
        cfg.update(use_sliding_window=False, sliding_window=None)
    if m.rope_scaling_args:
        f, lo, hi, orig = m.rope_scaling_args
        cfg["rope_scaling"] = {
            "rope_type": "llama3", "factor": f, "low_freq_factor": lo, "high_freq_factor": hi,
            "original_max_position_embeddings": orig,
        }  # fmt: skip
    return cfg


def hf_parts(name: str, tied: bool = False) -> list[str]:
    """The HF tensors whose row concatenation is megasparse global tensor ``name``."""
    if name == "embedding.weight":
        return ["model.embed_tokens.weight"]
    if name == "output_weight":
        return ["model.embed_tokens.weight" if tied else "lm_head.weight"]
    if name == "final_norm.weight":
        return ["model.norm.weight"]
    _, i, rest = name.split(".", 2)
    pre = f"model.layers.{i}."
    table = {
        "attn_norm.weight": ["input_layernorm.weight"],
        "mlp_norm.weight": ["post_attention_layernorm.weight"],
        "attn.qkv.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
        "attn.qkv_bias": ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
        "attn.proj.weight": ["self_attn.o_proj.weight"],
        "mlp.fc1.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
        "mlp.fc2.weight": ["mlp.down_proj.weight"],
    }
    if rest not in table:
        raise HFError(f"megasparse tensor {name} has no Hugging Face counterpart")
    return [pre + t for t in table[rest]]


def global_names(m) -> list[str]:
    """Every global tensor name of megasparse model config ``m``, in HF's usual order."""
    out = ["embedding.weight"]
    for i in range(m.num_layers):
        out += [f"layers.{i}.{n}" for n in ("attn_norm.weight", "attn.qkv.weight")]
        out += [f"layers.{i}.attn.qkv_bias"] if m.qkv_bias else []
        out += [f"layers.{i}.{n}" for n in ("attn.proj.weight", "mlp_norm.weight", "mlp.fc1.weight", "mlp.fc2.weight")]
    out.append("final_norm.weight")
    if not m.tie_embeddings:
        out.append("output_weight")
    return out
