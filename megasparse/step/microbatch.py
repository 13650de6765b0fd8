"""What runs for one micro-batch on this rank: ``MicrobatchStep``.

forward (this rank's model chunk; the last stage's per-token loss) → the loss function (the token filter's: it
selects the kept tokens, fills the kept rows the loss layer's backward reads and masks the loss; without a filter
the plain sum) → backward (autograd from the stage output, or from the scalar loss on the last stage).

The schedule (``step/schedule.py``) decides the order of these calls over a step's micro-batches and the executor
(``step/executor.py``) whether they run eagerly or as replayed CUDA graphs; this object owns what one call does and
the step's loss accumulator, which a graph executor points at its own static tensor (``loss_sum``).
"""

from __future__ import annotations

import torch

from megasparse.data.batch import Batch
from megasparse.ops.compact import KeepHolder
from megasparse.ops.documents import DocSpans

__all__ = ["MicrobatchStep"]


class MicrobatchStep:
    """One rank's micro-batch: ``forward(i, x, chunk)`` and ``backward(i, out, grad)`` over the batches of ``begin``.

    Components plug in here: the token filter's ``masked_loss`` is the loss function, the vocabulary-over-PP
    component (``loss/pipeline.py``: ``VocabOverPP``) supplies the first stage's embedded inputs."""

    def __init__(
        self,
        model,
        token_filter,
        vocab_pp,
        *,
        tokens_per_mb: int,
        num_mb: int,
        dp: int,
        dp_rank: int,
        eod: int | None = None,
        doc_kernel: str = "bias",
    ):
        """``num_mb``: micro-batches per optimizer step on this DP rank; the loss is normalised by the kept (or all)
        tokens of the global batch, ``per micro-batch × num_mb × dp``. ``eod``: the end-of-document id whose
        documents attention keeps apart (``data.document_attention``; None: off), ``doc_kernel`` the kernel that does
        it (``data.document_attention_kernel``, decision 1201)."""
        self.model, self.filter, self.vocab_pp, self.eod = model, token_filter, vocab_pp, eod
        self.doc_kernel = doc_kernel
        self.tokens_per_mb, self.num_mb, self.dp, self.dp_rank = tokens_per_mb, num_mb, dp, dp_rank
        self.batches: list[Batch] = []
        self.train, self.step, self.filtering, self.normaliser = False, 0, False, 1
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        """Sum of this rank's per-token losses over the step (last stage); a CUDA graph executor re-points it."""

    def begin(self, batches: list[Batch], train: bool, step: int, device: torch.device) -> None:
        """Start a step (training or evaluation) over ``batches``: the loss accumulator cleared, components told."""
        self.batches, self.train, self.step = batches, train, step
        self.filtering = train and self.filter is not None
        per_mb = self.filter.kept_rows if self.filtering else self.tokens_per_mb
        self.normaliser = per_mb * self.num_mb * self.dp  # kept (or all) tokens of the global batch
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        if self.vocab_pp is not None:
            self.vocab_pp.begin(batches, train)

    def loss(self, per_token: torch.Tensor, batch: Batch, keep: KeepHolder, i: int) -> torch.Tensor:
        """The scalar whose backward trains: the token filter's masked sum (it fills ``keep``) or the plain sum."""
        if not self.filtering:
            return per_token.sum() / self.normaliser
        mb_index = self.dp_rank + i * self.dp  # seeds random scores: distinct over DP ranks and micro-batches
        return self.filter.masked_loss(per_token, batch, keep, self.step, mb_index) / self.normaliser

    def forward(self, i: int, x: torch.Tensor | None, chunk: int = 0, batch: Batch | None = None) -> torch.Tensor:
        """Micro-batch i through this rank's chunk ``chunk``: the stage output, or on the last stage the loss.

        ``batch``: the tokens to use instead of ``batches[i]`` (a captured graph's static buffer)."""
        batch = self.batches[i] if batch is None else batch
        emb = None if self.vocab_pp is None else self.vocab_pp.input(i)
        ids = batch.ids if emb is None else emb
        keep, stage = KeepHolder(), self.model.chunks[chunk]  # virtual stages: this rank's chunk `chunk`
        # documents from the whole window's ids, which every stage and TP rank holds; on the device, inside a
        # captured graph too (from its static token buffer)
        docs = {} if self.eod is None else {"docs": DocSpans.from_ids(batch.ids, self.eod, self.doc_kernel)}
        out = stage(ids if stage.first else x, batch.targets, keep, **docs)
        if not stage.last:
            return out
        self.loss_sum += out.detach().double().sum()  # in place: a captured graph adds into its static tensor
        return self.loss(out, batch, keep, i)

    def backward(self, i: int, out: torch.Tensor, grad: torch.Tensor | None) -> None:
        """Autograd from micro-batch i's output (``grad``: the received output gradient; None on the last stage)."""
        torch.autograd.backward(out, grad)

    def slot(self):
        """The schedule's per-micro-batch hook of this step (the vocabulary-over-PP peers' loss slices), or None."""
        return None if self.vocab_pp is None else self.vocab_pp.slot(self.batches, self.train)

    def finish(self) -> None:
        """End the step: components that work over the whole step run now (the input embedding slices' backward)."""
        if self.vocab_pp is not None:
            self.vocab_pp.finish(self.train)
