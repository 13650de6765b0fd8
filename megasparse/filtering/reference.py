"""One entry point for the trainer: reference losses of a micro-batch's labels, from the configured source.

    ref = ReferenceLosses.from_config(cfg.filter, cfg.data.ref_losses, dataset_prefix)
    ref_loss = ref(tokens, labels, label_positions)     # [s, b] float32, on the tokens' device

``filter.reference``: ``sidecar`` gathers precomputed losses by ``.bin`` position (full document context, no
compute); ``ngram`` scores the micro-batch with the Kneser-Ney model on the host (context limited to the
sample); ``model`` (a same-architecture reference checkpoint) is built by ``filtering/component.py`` through
the model builder.
"""

from __future__ import annotations

import numpy as np
import torch

from megasparse.configbase import ConfigError
from megasparse.filtering.config import FilterConfig
from megasparse.filtering.ngram import NgramLM
from megasparse.filtering.sidecar import ChainedSidecars, gather_ref_losses, open_sidecar, open_sidecars

__all__ = ["ReferenceLosses"]


class ReferenceLosses:
    """Callable ``(tokens [s, b], labels [s, b], label_positions [s, b] | None) -> [s, b]`` reference losses."""

    def __init__(self, sidecar: np.ndarray | ChainedSidecars | None = None, ngram: NgramLM | None = None) -> None:
        if (sidecar is None) == (ngram is None):
            raise ValueError("ReferenceLosses needs exactly one of a sidecar or an n-gram model")
        self.sidecar, self.ngram = sidecar, ngram

    @classmethod
    def from_config(
        cls, cfg: FilterConfig, ref_losses_path: str | list[str] | None, prefix: str | list[str] | None
    ) -> ReferenceLosses:
        """``ref_losses_path`` is ``data.ref_losses``; ``prefix`` the resolved indexed dataset it belongs to
        (for a blend: lists, one sidecar per blended dataset, in blend order)."""
        if cfg.reference == "sidecar":
            if not ref_losses_path or not prefix:
                raise ConfigError(
                    "filter.reference=sidecar needs data.ref_losses (build it with `megasparse ref ngram "
                    "--sidecar-for` or `megasparse ref score`), or set filter.reference=ngram"
                )
            if isinstance(prefix, list) or isinstance(ref_losses_path, list):
                paths = ref_losses_path if isinstance(ref_losses_path, list) else [ref_losses_path]
                return cls(sidecar=open_sidecars(paths, prefix if isinstance(prefix, list) else [prefix]))
            return cls(sidecar=open_sidecar(ref_losses_path, prefix))
        if cfg.reference == "ngram":
            if not cfg.ngram_path:
                raise ConfigError(
                    "filter.reference=ngram needs filter.ngram_path (build it with `megasparse ref ngram`)"
                )
            return cls(ngram=NgramLM.load(cfg.ngram_path))
        raise ConfigError(
            f"filter.reference={cfg.reference!r} is served by the trainer's reference model, not ReferenceLosses"
        )

    def __call__(
        self, tokens: torch.Tensor, labels: torch.Tensor, label_positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.sidecar is not None:
            if label_positions is None:
                raise ValueError("a sidecar reference needs the labels' .bin positions (PackedDataset.positions)")
            return gather_ref_losses(self.sidecar, label_positions).to(labels.device)
        return self.ngram.label_losses(tokens, labels).to(labels.device)
