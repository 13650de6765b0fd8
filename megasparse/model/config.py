"""Model architecture config (Llama-style decoder)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megasparse.configbase import ConfigError


@dataclass
class ModelConfig:
    """Shape of the decoder. Defaults are a CPU toy; see configs/ for real sizes."""

    num_layers: int = 4
    """Transformer blocks in the whole model (split over pipeline stages)."""
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention; None means one per query head (MHA)."""
    ffn_hidden_size: int | None = None
    """SwiGLU inner size; None picks 8/3·hidden rounded up to a multiple of 64."""
    vocab_size: int | None = None
    """None takes the tokenizer's size; padded internally to a multiple of make_vocab_divisible_by·tp."""
    make_vocab_divisible_by: int = 64
    seq_length: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recompute (decision 0012): memory for backward work. selective: the attention's rotated q/k and
    the SwiGLU output are rebuilt in the backward instead of saved (an elementwise pass each; ~28% of a Llama-3-8B
    layer's saved activations). full: each transformer layer keeps only its input and runs its forward again in
    the backward (TP collectives included). Both keep the compact backward and CUDA-graph capture."""
    kv_channels: int | None = None
    """Per-head dimension (Megatron's name; Hugging Face's ``head_dim``) when it is not hidden/heads; None: that."""
    qkv_bias: bool = False
    """Biases on the q/k/v projection (Qwen2), split over TP like the weight and added before RoPE."""
    tie_embeddings: bool = False
    """One matrix for the input embedding and the output layer (Llama-3.2-1B/3B, small Qwen2); parallel.pp = 1."""
    rope_scaling: Literal["none", "llama3"] = "none"
    """RoPE frequency scaling: ``llama3`` (Llama-3.1/3.2) rescales the low frequencies by the keys below."""
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    """The context length the frequencies were scaled from (``original_max_position_embeddings``)."""

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def rope_scaling_args(self) -> tuple[float, float, float, int] | None:
        """(factor, low, high, original positions) for ``ops.attention.rope_tables``; None without scaling."""
        if self.rope_scaling == "none":
            return None
        return (
            self.rope_scaling_factor,
            self.rope_low_freq_factor,
            self.rope_high_freq_factor,
            self.rope_original_max_positions,
        )

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return ((8 * self.hidden_size // 3) + 63) // 64 * 64

    def validate(self) -> None:
        if self.recompute not in ("none", "selective", "full"):
            raise ConfigError(f"model.recompute={self.recompute!r}: use none, selective or full")
        for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"model.{key} must be positive, got {getattr(self, key)}")
        if self.kv_channels is not None and self.kv_channels <= 0:
            raise ConfigError(f"model.kv_channels={self.kv_channels} must be positive (or null: hidden/heads)")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"model.num_attention_heads={self.num_attention_heads}; pick heads that divide it"
            )
        if self.num_attention_heads % self.kv_heads:
            raise ConfigError(
                f"model.num_attention_heads={self.num_attention_heads} is not divisible by "
                f"model.num_query_groups={self.kv_heads}; GQA needs whole groups"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head dim {self.head_dim} must be even for RoPE; change model.hidden_size")
        if self.rope_scaling == "llama3" and not (
            self.rope_scaling_factor > 0 and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor
        ):
            raise ConfigError(
                "model.rope_scaling=llama3 needs rope_scaling_factor > 0 and 0 < rope_low_freq_factor < "
                f"rope_high_freq_factor, got {self.rope_scaling_factor}, {self.rope_low_freq_factor}, "
                f"{self.rope_high_freq_factor}"
            )
