"""Data config: indexed datasets (one, or a weighted blend), tokenizer, packing and the validation split."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from megasparse.configbase import ConfigError

DEFAULT_PREFIX = "builtin:shakespeare"


@dataclass
class DataConfig:
    """Where tokens come from. ``prefix`` names a Megatron indexed dataset (prefix.bin / prefix.idx); ``blend``
    mixes several by weight instead."""

    prefix: str = DEFAULT_PREFIX
    """Indexed-dataset prefix, or ``builtin:shakespeare`` to build the bundled corpus on first use. With
    ``data.blend`` it must stay at this default (it is then unused)."""
    blend: list[str] | str | None = None
    """Several indexed datasets mixed by weight, in Megatron's ``--data-path`` format: ``[0.3, /d/a_text_document,
    0.7, /d/b_text_document]`` (weights are normalised), a list of prefixes (equal weights), or the same as one
    whitespace-separated string. Each is split and packed like ``prefix``; samples are dealt out by Megatron's
    greedy blend (decision 0103)."""
    tokenizer: str = "builtin:shakespeare"
    """Path to a tokenizers JSON file, or ``builtin:shakespeare`` (a BPE trained offline on the corpus)."""
    tokenizer_vocab: int = 8192
    """Vocabulary size of the built-in BPE (only used for ``builtin:`` tokenizers)."""
    cache_dir: str = "~/.cache/megasparse"
    """Where the built-in corpus, tokenizer and indexed dataset are built once (``$MEGASPARSE_CACHE``
    replaces this default)."""
    valid_fraction: float = 0.02
    """Fraction of documents held out for validation (chosen by a seeded shuffle of documents)."""
    seed: int = 1234
    """Seed of the document split and the sample order."""
    reference_prefix: str | None = None
    """Indexed dataset of high-quality reference text (token filtering's reference model / n-gram); with
    ``prefix = builtin:shakespeare`` it defaults to the bundled Milton corpus."""
    ref_losses: str | list[str] | None = None
    """Optional sidecar of per-token reference losses aligned with ``prefix`` (token filtering); with
    ``data.blend``, a list of one sidecar per blend entry, in blend order."""
    document_attention: bool = False
    """Keep packed documents apart (Megatron's reset_attention_mask + reset_position_ids): a token attends only to
    earlier tokens of its own document (up to and including the EOD that ends it) and RoPE positions restart at 0
    after each EOD. Costs a [b, s, s] attention bias per micro-batch (docs/documents.md, decision 1200)."""
    document_attention_kernel: Literal["auto", "flex", "bias"] = "auto"
    """The training step's kernel for ``document_attention``: ``flex`` (FlexAttention with a block mask: tiles
    outside the documents skipped; compiled on CUDA, eager and slow on CPU), ``bias`` (an additive s × s mask into
    cuDNN / the CPU kernel), ``auto`` (flex on CUDA at bf16/fp16, the bias elsewhere). Decision 1201."""

    def validate(self) -> None:
        if not 0.0 < self.valid_fraction < 0.5:
            raise ConfigError(f"data.valid_fraction={self.valid_fraction} must be in (0, 0.5)")
        if self.document_attention and self.prefix == "synthetic" and self.blend is None:
            raise ConfigError(
                "data.document_attention: synthetic data (data.prefix=synthetic) has no documents; use an indexed "
                "dataset or set data.document_attention=false"
            )
        if self.document_attention_kernel == "flex" and not _has_flex():
            raise ConfigError(
                "data.document_attention_kernel=flex: this torch has no FlexAttention (torch.nn.attention."
                "flex_attention); use auto or bias"
            )
        if self.tokenizer_vocab <= 257:
            raise ConfigError(f"data.tokenizer_vocab={self.tokenizer_vocab} must exceed 257 (bytes + EOD)")
        if self.blend is None:
            if isinstance(self.ref_losses, list):
                raise ConfigError("data.ref_losses: give one sidecar path with data.prefix (a list is for data.blend)")
            return
        entries = self.blend_entries()
        if self.prefix != DEFAULT_PREFIX:
            raise ConfigError(
                f"data.prefix={self.prefix} and data.blend are mutually exclusive; drop data.prefix "
                "(or put it into the blend)"
            )
        if self.ref_losses is not None and (
            not isinstance(self.ref_losses, list) or len(self.ref_losses) != len(entries)
        ):
            raise ConfigError(
                f"data.ref_losses: with data.blend give a list of {len(entries)} sidecars, one per blend entry "
                "in blend order"
            )

    def blend_entries(self) -> list[tuple[float, str]]:
        """(weight, prefix) per blend entry, weights as given (not normalised); parsed like megatron's
        ``get_blend_from_list``: alternating weights and prefixes, or prefixes only (weight 1 each)."""
        raw = self.blend.split() if isinstance(self.blend, str) else list(self.blend or [])
        raw = [str(x).strip() for x in raw]
        if not raw or any(not x for x in raw):
            raise ConfigError(f"data.blend={self.blend!r}: give [weight, prefix, weight, prefix, ...] or [prefix, ...]")
        weights = [_number(x) for x in raw[0::2]] if len(raw) % 2 == 0 else [None]
        if all(w is not None for w in weights):
            prefixes = raw[1::2]
            if any(_number(p) is not None for p in prefixes):
                raise ConfigError(
                    f"data.blend={self.blend!r}: weights and prefixes must alternate: [0.3, prefix_a, 0.7, prefix_b]"
                )
            for w, p in zip(weights, prefixes):
                if not (math.isfinite(w) and w > 0):
                    raise ConfigError(f"data.blend: the weight {w} of {p} must be a positive number")
            return list(zip(weights, prefixes))
        if any(_number(x) is not None for x in raw):
            raise ConfigError(
                f"data.blend={self.blend!r}: weights and prefixes must alternate: [0.3, prefix_a, 0.7, prefix_b] "
                "(or give prefixes only for equal weights)"
            )
        return [(1.0, p) for p in raw]


def _has_flex() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None
