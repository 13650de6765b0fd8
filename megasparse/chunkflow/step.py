"""The trainer's step under ``chunkflow.enabled``: this rank's chunks of the step's whole sequences.

``ChunkFlowStep.batches(step)`` reads the step's sequences, plans the chunks (``plan.py``, the same on every rank)
and returns this rank's groups; ``len()`` of them is the number of backward passes, which the DP buckets' overlap
hooks count (``zero_grad(len(batches))``). Calling the step runs each group (``state.run_group``: a long sequence's
chunks forward in order, backward in reverse) and returns the summed per-token loss and this rank's share of the
step's real predictions, so the trainer's mean loss and tokens/s are over real tokens only. The loss of every chunk
is normalised by the step's real predictions (its kept ones under ``filter.mode=loss_mask`` or ``collider``), known
on every rank from the plan: no collective. Under collider the kept rows also go to the loss layer (``KeepHolder``),
so the chunk's backward is compact, across chunk boundaries too (decision 1223). A long sequence's last chunk that
also holds short documents (``chunkflow.pack_tails``, decision 1233) runs the prefix attention with their document
spans, built from the plan's pieces (``_tail_spans``), and its tail's row count (``ChunkKV.pack``); on CUDA the
first ``batches`` call compiles those chunks' FlexAttention variants for the run's steps (``tailwarm.py``).
``filter.scorer=excess`` scores each of the rank's sequences whole with the reference on the last stage, once per
step (decision 1227).

On one stage the order is group by group (all chunks of one sequence forward, then backward in reverse). Under
pp > 1 every stage runs its row of a slot table (``schedule.py``: by default the state-aware 1F1B, where the
single-chunk groups fill a long sequence's fill and drain; decision 1226) through ``state.run_schedule``
(decision 1222: why this is not a ``step/schedule.py`` schedule).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, partial

import numpy as np
import torch

from megasparse.chunkflow.config import frees_sends, sequence_limit, tails_packed
from megasparse.chunkflow.data import sequence_source
from megasparse.chunkflow.filter import ChunkReference, ChunkSelection
from megasparse.chunkflow.plan import Chunk, Group, StepPlan, chunk_arrays, plan_step
from megasparse.chunkflow.schedule import COST, UNIT, Schedule, gpipe_per_group, state_aware
from megasparse.chunkflow.state import ChunkKV, run_group, run_schedule
from megasparse.chunkflow.tailwarm import tail_width, warm_tails
from megasparse.ops.compact import KeepHolder, KeepMeta
from megasparse.ops.documents import DocSpans
from megasparse.parallel.pipeline import StageComm

__all__ = ["ChunkFlowStep", "RankChunks", "chunk_step"]


@dataclass
class RankChunks:
    """One step's plan, this rank's groups and the step's sequences (what the step's call runs)."""

    plan: StepPlan
    groups: list[Group]
    sequences: list[np.ndarray]
    positions: list[np.ndarray | None] | None = None
    """The sequences' ``.bin`` offsets (``SequenceDataset.global_positions``), read for a sidecar reference."""

    def __len__(self) -> int:
        """Backward passes of this rank's step: one per chunk (a rerun chunk's forward is not one)."""
        return sum(len(g.chunks) for g in self.groups)


class ChunkFlowStep:
    """``step.batches(step_no)`` then ``step(batches, True, step_no)`` -> (summed per-token loss, real tokens)."""

    def __init__(self, model, source, *, chunk_size: int, per_step: int, keep: int, dp: int, dp_rank: int,
                 device: torch.device, eod: int | None = None, max_length: int | None = None,
                 p2p: StageComm | None = None, selection: ChunkSelection | None = None,
                 schedule: Callable[[int, tuple[int, ...], int], Schedule] = state_aware,
                 doc_kernel: str = "bias", reference: ChunkReference | None = None,
                 pack_tails: bool = False, steps: int | None = None, free_sends: bool = False):  # fmt: skip
        """``source``: ``step_sequences(step, n)``; ``keep``: K, chunks of a sequence whose activations stay;
        ``eod``: the end-of-document id when the model keeps packed documents apart (``ops/documents.py``'s
        ``DocSpans``, ``data.document_attention``): short sequences are then packed several per chunk; None: one
        per chunk. ``p2p``: the stage's transfers (pipeline stages; None: a single stage, every group through
        ``state.run_group``). ``selection``: ``filter.mode=loss_mask`` or ``collider`` over each chunk's real
        tokens. ``schedule``: the pipeline's slot table for (pp, chunks per group, K) (``schedule.py``; decision
        1226); under collider each compact gradient's receive takes its chunk's kept count from the plan and the
        kept positions cross with a long group's first backward (``state.run_schedule``, decision 1223).
        ``doc_kernel``: the kernel of a packed chunk's document attention (``data.document_attention_kernel``,
        decision 1201). ``reference``: the excess scorer's reference losses (the last stage's; decision 1227).
        ``pack_tails`` (with ``eod``): short sequences also fill long sequences' last chunks (decision 1233);
        ``steps``: the run's last step (``train.steps``), up to which the first ``batches`` call compiles their
        FlexAttention variants (``tailwarm.py``, decision 1241; None: only a caller's ``warm_tails``).
        ``free_sends``: the stages' sends never wait for their receivers (``pipeline.FreeSends``; ``schedule``
        should then build its tables with ``schedule.COST``, decision 1249)."""
        self.schedule, self.free_sends = schedule, free_sends
        self.stage = model.chunks[0]
        assert len(model.chunks) == 1, "ChunkFlow runs one model chunk per stage (no virtual stages)"
        self.p2p = p2p
        self.source, self.c, self.per_step, self.keep = source, chunk_size, per_step, keep
        self.dp, self.dp_rank, self.device, self.eod, self.max_length = dp, dp_rank, device, eod, max_length
        self.pack, self.selection, self.doc_kernel, self.reference = eod is not None, selection, doc_kernel, reference
        self.pack_tails, self.steps = pack_tails, steps
        self.tail_warmup: dict | None = None
        """``tailwarm.warm_tails``' record (prefix lengths, variants, compile seconds) once it ran."""
        self.seen: int | None = None
        """Real predictions trained so far, over all ranks (counted from the data at the first step: resumes too)."""
        self.last: dict = {}
        """The last step's metrics: real predictions, chunks, their fill (real / label slots) and, filtering, the
        kept share of the real predictions, over all ranks."""

    def _documents(self, ids: torch.Tensor) -> dict:
        """A packed chunk's documents for the model (document attention: decision 1200's ``DocSpans``)."""
        return {"docs": DocSpans.from_ids(ids, self.eod, self.doc_kernel)}

    @cached_property
    def tail_width(self) -> int | None:
        """The packed last chunks' flex keys, padded to the longest sequence's chunks: one compiled variant for
        every prefix (``tailwarm.tail_width``; None: the source cannot say its longest sequence)."""
        return tail_width(self.source, self.c, self.max_length)

    def tail_spans(self, chunk: Chunk, starts: list[int]) -> DocSpans:
        """The spans of a long sequence's last chunk holding short documents (``_tail_spans``; the warm-up's too)."""
        return _tail_spans(chunk, starts, self.c, self.device, self.doc_kernel)

    def batches(self, step: int) -> RankChunks:
        if self.tail_warmup is None and self.steps is not None and self.pack and self.pack_tails:
            warm_tails(self, range(step, max(step + 1, self.steps)))  # from the step a resume starts at
        read = self.source.step_sequences(step, self.per_step)
        seqs = [np.asarray(t) for _, t in read]
        plan = plan_step([len(t) for t in seqs], self.c, self.dp, self.pack, self.max_length, self.pack_tails)
        where = getattr(self.source, "global_positions", None) if self.reference is not None else None
        positions = None if where is None else [where(g) for g, _ in read]
        return RankChunks(plan, plan.rank_groups(self.dp_rank), seqs, positions)

    def __call__(self, work: RankChunks, train: bool, step_no: int) -> tuple[torch.Tensor, float]:
        assert train, "ChunkFlow steps train; evaluation runs the fixed-length path"
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        plan, sel = work.plan, self.selection
        kept = plan.real_tokens if sel is None else sel.kept(plan)
        fwds = [self._forward(g, work, loss_sum, max(kept, 1), step_no) for g in work.groups]
        if self.p2p is None:
            for group, fwd in zip(work.groups, fwds):
                run_group(fwd, [c.offset for c in group.chunks], self.c, self.keep)
        else:
            lay = self.p2p.lay
            sizes = tuple(len(g.chunks) for g in work.groups)
            table = self.schedule(lay.pp, sizes, self.keep)
            offsets = [[c.offset for c in g.chunks] for g in work.groups]
            collider = sel is not None and sel.collider
            counts = [[sel.count(c) for c in g.chunks] for g in work.groups] if collider else None
            run_schedule(table, lay.pp_rank, fwds, offsets, self.c, self.p2p, counts, self.free_sends)
        fill = plan.real_tokens / max(plan.slots, 1)
        if self.seen is None:  # a source that cannot count its past (a test's fixed list) starts from 0
            before = getattr(self.source, "predictions_before", lambda g: 0)
            self.seen = before(step_no * self.per_step)
        self.seen += plan.real_tokens
        self.last = dict(real_tokens=plan.real_tokens, chunks=plan.num_chunks, chunk_fill=fill, tokens_seen=self.seen)
        if sel is not None:
            self.last["real_kept_share"] = kept / max(plan.real_tokens, 1)
        return loss_sum, work.plan.real_tokens / self.dp

    def _forward(self, group: Group, work: RankChunks, loss_sum: torch.Tensor, normaliser: int, step: int):
        """``state.Forward`` of ``group``'s chunks on this stage (``kv`` None: a chunk with no earlier chunks)."""
        sequences = work.sequences
        arrays = [chunk_arrays(c, sequences, self.c) for c in group.chunks]
        ids = [torch.from_numpy(a[0][:-1]).to(self.device).view(-1, 1) for a in arrays]
        targets = [torch.from_numpy(a[1]).to(self.device) for a in arrays]
        packed = len(group.chunks) == 1 and self.pack  # whole documents from position 0: no state to carry
        stage, chosen, scored = self.stage, {}, {}

        def reference(j: int) -> torch.Tensor | None:
            """Chunk j's reference losses (excess), each of the group's sequences scored whole once."""
            if self.reference is None:
                return None
            for p in group.chunks[j].pieces:
                if p.seq not in scored:
                    at = None if work.positions is None else work.positions[p.seq]
                    scored[p.seq] = self.reference.sequence(sequences[p.seq], at)
            return ChunkReference.chunk(group.chunks[j], scored, self.c)

        def forward(j: int, x: torch.Tensor | None, kv: ChunkKV | None, first: bool) -> torch.Tensor:
            ctx = self._documents(ids[j]) if packed else ({} if kv is None else {"kv": kv})
            chunk = group.chunks[j]
            if kv is not None and len(chunk.pieces) > 1:  # a long sequence's last chunk holding short documents
                # spans made per forward, like a packed chunk's: their memoised masks go with this chunk's graph
                spans = self.tail_spans(chunk, arrays[j][2])
                kv.pack(spans, chunk.pieces[0].count, self.tail_width)
            keep = KeepHolder()
            out = stage(ids[j] if stage.first else x, targets[j], keep, **ctx)
            if not stage.last:
                return out
            if first:
                loss_sum.add_(out.detach().double().sum())  # per-token losses, 0 at padding (ignored labels)
            sel = self.selection
            if sel is not None:  # only the kept real tokens train
                if j not in chosen:  # a rerun keeps the first forward's tokens (the later chunks trained on them)
                    chosen[j] = sel.rows(out, arrays[j][1], group.chunks[j], step, reference(j))
                rows = chosen[j]
                if sel.collider:  # the compact backward from the loss layer on (decision 1223)
                    keep.meta = KeepMeta(rows, out.numel(), 1, seq_count=rows.numel())
                    if kv is not None and first:
                        kv.keep_rows(rows)
                out = out * torch.zeros_like(out).index_fill_(0, rows, 1.0)
            return out.sum() / normaliser

        return forward


def _tail_spans(chunk: Chunk, starts: list[int], c: int, device: torch.device, kernel: str) -> DocSpans:
    """The documents of a long sequence's last chunk that also holds short ones: piece i is document i, at positions
    from the chunk's ``offset`` (the tail) or from 0 (the packed documents), taken from the plan rather than from
    end-of-document ids (a long sequence may hold one inside); the padding after them is one more document.
    ``kernel``: ``data.document_attention_kernel``, as for the packed chunks (flex or the bias, decision 1239)."""
    seg = np.full(c, len(chunk.pieces), dtype=np.int64)
    pos = np.arange(c, dtype=np.int64)
    end = 0
    for i, (p, at) in enumerate(zip(chunk.pieces, starts)):
        end = min(at + p.count, c)  # a piece's last token may be only a label (slot c)
        seg[at:end] = i
        pos[at:end] = np.arange(end - at) + (chunk.offset if i == 0 else 0)
    pos[end:] -= end
    to = partial(torch.as_tensor, device=device)
    return DocSpans(to(seg).view(-1, 1), to(pos).view(-1, 1), kernel)


def chunk_step(
    cfg, model, vocab: int, dp: int, dp_rank: int, device: torch.device, p2p: StageComm | None = None, tf=None
) -> ChunkFlowStep | None:
    """The run's ChunkFlow step, or None when ``chunkflow.enabled`` is off. Short sequences are packed several per
    chunk under ``data.document_attention``, else take a chunk each (decision 1221). ``tf``: the run's
    ``TokenFilter`` (or None), whose reference source the excess scorer reads (the last stage's; decision 1227)."""
    cf = cfg.chunkflow
    if not cf.enabled:
        return None
    source = sequence_source(cfg, vocab)
    reference = getattr(tf, "reference", None)
    eod = source.eod_id if getattr(cfg.data, "document_attention", False) else None
    doc_kernel = getattr(cfg.data, "document_attention_kernel", "bias")
    free = p2p is not None and frees_sends(cfg)
    return ChunkFlowStep(
        model, source, chunk_size=cfg.model.seq_length, per_step=cfg.train.global_batch_size,
        keep=cf.max_chunks_in_memory, dp=dp, dp_rank=dp_rank, device=device, eod=eod,
        max_length=sequence_limit(cfg), p2p=p2p, selection=_selection(cfg), doc_kernel=doc_kernel,
        schedule=pipeline_schedule(cf, free), reference=None if reference is None else ChunkReference(reference),
        pack_tails=tails_packed(cfg, device.type == "cuda"), steps=cfg.train.steps, free_sends=free,
    )  # fmt: skip


def pipeline_schedule(cf, free_sends: bool = False) -> Callable[[int, tuple[int, ...], int], Schedule]:
    """``chunkflow.pipeline_schedule``'s table builder (``cf``: the ``chunkflow`` section): one slot per op for
    rendezvous transfers, ``COST``'s proportions where sends never wait (decision 1249)."""
    cost = COST if free_sends else UNIT
    if cf.pipeline_schedule == "gpipe":
        return partial(gpipe_per_group, cost=cost)
    return partial(state_aware, window=cf.sequences_in_flight, cost=cost)


def _selection(cfg) -> ChunkSelection | None:
    f = cfg.filter
    if f.mode == "off":
        return None
    return ChunkSelection(f.keep_ratio, f.scorer, cfg.train.seed, collider=f.mode == "collider")
