"""Documents inside a packed window (``data.document_attention``, decision 1200): which document each token belongs
to, its position in that document, and the attention mask that keeps every token inside its own document.

A window of packed documents is [s, b] token ids with an end-of-document (EOD) id closing each document. The EOD
belongs to the document it ends; the token after it starts the next one at position 0 (Megatron's
``reset_attention_mask`` + ``reset_position_ids``). Everything here is computed on the device from the ids with
shapes fixed by [s, b] alone: no host synchronisation, so a captured CUDA graph recomputes it from its static
token buffer on every replay.

The mask is built for all rows of a window, or for a subset of kept rows (the compact backward of token
filtering: a kept row keeps its document and its original position). ``reference_attention`` is the fp64 masked
causal attention the tests compare the kernels against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["DocSpans", "additive_bias", "reference_attention"]


@dataclass(eq=False)
class DocSpans:
    """Per-token document index and position in the document of one micro-batch's [s, b] window.

    One object per micro-batch, shared by every layer; masks and biases derived from it are memoised here."""

    segments: torch.Tensor
    """int64 [s, b]: the document each token belongs to, counted from 0 at the window's start (per sequence)."""
    positions: torch.Tensor
    """int64 [s, b]: the token's position in its document (0 at the token after an EOD, or at the window's start)."""
    kernel: str = "bias"
    """``data.document_attention_kernel``: ``bias`` (the additive mask), ``flex`` (FlexAttention, ``doc_flex.py``,
    decision 1201) or ``auto`` (flex on CUDA at bf16/fp16, the bias elsewhere)."""
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_ids(cls, ids: torch.Tensor, eod: int, kernel: str = "bias") -> DocSpans:
        """Spans of token ids [s, b] whose documents end with ``eod`` (the EOD belongs to the document it ends);
        ``kernel``: the attention kernel that reads them (``DocSpans.kernel``)."""
        s = ids.shape[0]
        is_eod = (ids == eod).long()
        segments = is_eod.cumsum(0) - is_eod  # EODs strictly before each token
        t = torch.arange(s, device=ids.device)[:, None]
        # the start of a token's document: one past the last EOD before it (0 if none), from a running maximum
        after_eod = torch.where(is_eod.bool(), t + 1, torch.zeros_like(t))
        start = torch.cummax(after_eod, 0).values
        start = torch.cat([torch.zeros_like(start[:1]), start[:-1]])
        return cls(segments, t - start, kernel)

    def derived(self, key: object, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Memoise something built from these spans (masks, biases) for every layer of the micro-batch."""
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    def rope_positions(self) -> torch.Tensor:
        """[b, s] positions in the per-sequence layout ``rope_into`` reads."""
        return self.derived("rope_pos", lambda: self.positions.t().contiguous())

    def allowed(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """bool [b, 1, m, m]: query i may attend key j (causal and the same document).

        ``rows`` [b, m]: the kept positions of each sequence, ascending, padded at the end by repeating the last
        (``KeepMeta.padded_per_sequence``); None: every position (m = s). Causality is taken over the row index,
        so a real query never sees a padded key after it, and the diagonal is always allowed (no empty row)."""
        seg = self.segments.t()  # [b, s]
        if rows is not None:
            seg = seg.gather(1, rows)
        m = seg.shape[1]
        causal = torch.ones(m, m, dtype=torch.bool, device=seg.device).tril()
        return (causal & (seg[:, :, None] == seg[:, None, :]))[:, None]


def additive_bias(allowed: torch.Tensor, dtype: torch.dtype, align: int = 1) -> torch.Tensor:
    """The mask as an additive bias (0 where allowed, −inf elsewhere) of ``dtype``, [b, 1, m, m].

    ``align``: rows are laid out with a stride rounded up to this many elements (the CUDA kernels read the bias in
    16-byte vectors); the returned tensor is a view of the first m columns."""
    b, _, m, n = allowed.shape
    width = -(-n // align) * align
    bias = torch.zeros(b, 1, m, width, dtype=dtype, device=allowed.device)[..., :n]
    return bias.masked_fill_(~allowed, float("-inf"))


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """Masked attention in fp64 (differentiable): q [b, h, m, d], k/v [b, h_kv, m, d] (GQA: h a multiple of
    h_kv), ``allowed`` bool [b, 1, m, m]; returns [b, h, m, d] fp64."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
