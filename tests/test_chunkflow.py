"""ChunkFlow (``megasparse/chunkflow/``, issue 30): the plan covers every real token once, balances DP ranks and
packs short documents into long sequences' last chunks (decision 1233: also through every exactness case below that
packs); a chunk's prefix attention (dense and Collider's compact backward, a packed last chunk's too) equals its
plain-torch reference; training on chunks
(K = 1 and K = all) gives the same per-token losses, gradients and optimizer step as training each sequence whole,
at tp 1, tp 2 + SP and dp 2, and so does token filtering on chunks (loss_mask; collider against whole-sequence
collider on the same kept tokens, also at tp 2 × pp 2 + SP; excess selection with the sidecar and n-gram references
against whole-sequence excess, decision 1227); the activations kept follow K, not the number of chunks; bad configs
are one line.

Why this file is long: one whole-sequence reference machinery (``_whole_sequences``, ``_chunked``, ``_grads``)
serves every layout and filter mode; split up, each file would import it from the other."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from distributed import run_distributed
from test_filtering_trainer import corpus, overrides  # noqa: F401  (the indexed corpus with its sidecar)
from tiny import TRAINING, tiny

from megasparse.chunkflow.data import LongTailSequences
from megasparse.chunkflow.plan import IGNORE, chunk_arrays, plan_step
from megasparse.config import ConfigError, load_config
from megasparse.ops.attention import rope_tables
from megasparse.ops.prefix_attention import prefix_attention, prefix_attention_reference

C = 16  # tiny()'s model.seq_length: the chunk size
LENGTHS = [3 * C + 10, 5, 2 * C + 1, C + 1, 11, 2, 3]
"""Tokens of the step's sequences: 4 chunks (last padded), 5 tokens, 2 whole chunks, exactly one chunk, ..."""


def _sequences(lengths=LENGTHS, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        t = rng.integers(1, 250, n)
        t[-1] = 0
        out.append(t)
    return out


# -- the plan ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("pack", "tails"), [(True, True), (True, False), (False, True)])
def test_plan_covers_every_real_token_once(pack: bool, tails: bool) -> None:
    seqs = _sequences()
    plan = plan_step([len(s) for s in seqs], C, dp=2, pack=pack, tails=tails)
    seen: dict[tuple[int, int], int] = {}
    slots = 0
    for group in plan.groups:
        for j, chunk in enumerate(group.chunks):
            tokens, labels, starts = chunk_arrays(chunk, seqs, C)
            slots += labels.size
            assert chunk.used <= C + 1  # no piece crosses a chunk
            # a long sequence's pieces are its chunks' first; short documents only after its last piece
            assert all(p.start == 0 and LENGTHS[p.seq] <= C + 1 for p in chunk.pieces[1:])
            assert len(chunk.pieces) == 1 or len(group.chunks) == 1 or j == len(group.chunks) - 1
            assert chunk.offset == (chunk.pieces[0].start if len(group.chunks) > 1 else 0)
            for p, at in zip(chunk.pieces, starts):
                for i in range(p.count - 1):  # label slot at+i predicts token start+i+1 of sequence p.seq
                    assert labels[at + i] == seqs[p.seq][p.start + i + 1]
                    key = (p.seq, p.start + i + 1)
                    seen[key] = seen.get(key, 0) + 1
    want = {(s, i) for s, n in enumerate(LENGTHS) for i in range(1, n)}
    assert set(seen) == want and set(seen.values()) == {1}
    assert plan.real_tokens == sum(n - 1 for n in LENGTHS) == len(want)
    assert plan.slots == slots and plan.num_chunks * C == slots  # padding counted: every slot that runs
    assert sum(plan.loads) == plan.real_tokens
    assert (plan.num_chunks < 4 + 2 + 5) if pack else (plan.num_chunks == 4 + 2 + 5)  # 5 shorts: one chunk each
    tail = plan.groups[0].chunks[-1]  # the 4-chunk sequence's last piece: 10 tokens, 7 free slots
    assert [(p.seq, p.count) for p in tail.pieces] == ([(0, 10), (1, 5), (5, 2)] if pack and tails else [(0, 10)])


def test_plan_packs_short_sequences_into_long_tails() -> None:
    """The benchmark's long-tail set (chunks of 8192, up to 32K tokens; fewer documents and steps here): the
    padding of long sequences' last chunks, 8% of the slots, is filled by short documents (decision 1233)."""
    from megasparse.data.longtail import LongTailSpec, longtail_lengths

    spec = LongTailSpec(docs=3000, vocab=128256, max_length=32768, seed=0, min_length=16)
    lengths, rng = longtail_lengths(spec, np.random.default_rng(0)), np.random.default_rng(1)
    fill, chunks = {True: [0, 0], False: [0, 0]}, {True: 0, False: 0}
    for _ in range(12):
        step = [int(lengths[i]) for i in rng.choice(len(lengths), 137, replace=False)]
        for tails in (True, False):
            plan = plan_step(step, 8192, 1, tails=tails)
            fill[tails][0] += plan.real_tokens
            fill[tails][1] += plan.slots
            chunks[tails] += plan.num_chunks
            assert sum(c.real for g in plan.groups for c in g.chunks) == sum(n - 1 for n in step)
            carrying = [g.chunks[-1] for g in plan.groups if len(g.chunks) > 1 and len(g.chunks[-1].pieces) > 1]
            assert bool(carrying) == tails
    packed, padded = (fill[t][0] / fill[t][1] for t in (True, False))
    assert padded < 0.90 and packed > 0.975, (
        packed,
        padded,
    )  # measured 0.895 -> 0.982 (60 steps of 10000: 0.900 -> 0.986)
    assert chunks[True] < 0.93 * chunks[False]


def test_plan_separates_packed_documents_and_pads() -> None:
    seqs = _sequences([5, 7, 3])
    (group,) = plan_step([5, 7, 3], C, dp=1).groups
    tokens, labels, starts = chunk_arrays(group.chunks[0], seqs, C)
    assert starts == [0, 7, 12]  # longest first: 7, 5, 3 tokens
    boundary = [6, 11]  # a document's last token is only a label: its slot predicts nothing across documents
    assert all(labels[b] == IGNORE for b in boundary)
    assert (labels != IGNORE).sum() == 4 + 6 + 2 and (labels[14:] == IGNORE).all()


def test_plan_balances_dp_ranks_and_is_deterministic() -> None:
    src = LongTailSequences(vocab=100, max_length=64 * C, seed=3)
    lengths = [src.length(g) for g in range(256)]
    assert max(lengths) > 16 * C and np.median(lengths) < 2 * C  # a long tail
    for dp in (2, 4, 8):
        plan = plan_step(lengths, C, dp=dp)
        ideal = plan.real_tokens / dp
        assert max(plan.loads) - ideal <= C, (dp, plan.loads, ideal)  # within one chunk of the ideal
        again = plan_step(list(lengths), C, dp=dp)
        assert again.owner == plan.owner and again.loads == plan.loads
        for g, _r in zip(plan.groups, plan.owner):  # a long sequence's chunks stay together on one rank
            assert len({c.pieces[0].seq for c in g.chunks}) == 1
    with pytest.raises(ValueError, match="max_sequence_length=100"):
        plan_step([50, 101], C, dp=1, max_length=100)


# -- the prefix attention ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("s", "prefix", "nq", "nkv", "bias"), [(5, 0, 2, 2, False), (7, 9, 4, 2, True), (3, 16, 3, 1, False)]
)
def test_prefix_attention_matches_reference(s: int, prefix: int, nq: int, nkv: int, bias: bool) -> None:
    torch.manual_seed(s + prefix)
    d, b = 8, 2
    dt = torch.float64
    cos, sin = rope_tables(64, d, 10000.0, "cpu", dt)
    qkv = torch.randn(s, b, (nq + 2 * nkv) * d, dtype=dt, requires_grad=True)
    bias_t = torch.randn((nq + 2 * nkv) * d, dtype=dt, requires_grad=True) if bias else None
    kp = torch.randn(b, nkv, prefix, d, dtype=dt, requires_grad=True)
    vp = torch.randn(b, nkv, prefix, d, dtype=dt, requires_grad=True)

    class Source:
        got: tuple | None = None

        def prefix(self):
            return (kp.detach(), vp.detach()) if prefix else None

        def add_grad(self, dk, dv):
            self.got = (dk, dv)

    src = Source()
    outs = prefix_attention(qkv, nq, nkv, cos, sin, prefix, src, bias_t)
    grads = [torch.randn_like(t) for t in outs]
    torch.autograd.backward(outs, grads)
    mine = [qkv.grad.clone()] + ([bias_t.grad.clone()] if bias else [])
    qkv.grad = None
    ref = prefix_attention_reference(qkv, nq, nkv, cos, sin, prefix, kp if prefix else None, vp, bias_t)
    for a, r in zip(outs, ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)
    if bias:
        bias_t.grad = None
    torch.autograd.backward(ref, grads)
    torch.testing.assert_close(mine[0], qkv.grad, rtol=1e-10, atol=1e-10)
    if bias:
        torch.testing.assert_close(mine[1], bias_t.grad, rtol=1e-10, atol=1e-10)
    if prefix:
        torch.testing.assert_close(src.got[0], kp.grad, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(src.got[1], vp.grad, rtol=1e-10, atol=1e-10)
    else:
        assert src.got is None


@pytest.mark.parametrize(("s", "prefix", "nq", "nkv", "bias"), [(7, 9, 4, 2, True), (5, 0, 2, 2, False)])
def test_prefix_attention_compact_backward_matches_collider_reference(s, prefix, nq, nkv, bias) -> None:
    """Collider: the kept queries' gradients reach only the kept keys/values, the prefix's included; the compact
    input gradient and the prefix's kept rows equal the reference's cut graph (fp64)."""
    from megasparse.ops.compact import CompactGrad, KeepMeta

    torch.manual_seed(s + prefix)
    d, dt = 8, torch.float64
    cos, sin = rope_tables(64, d, 10000.0, "cpu", dt)
    qkv = torch.randn(s, 1, (nq + 2 * nkv) * d, dtype=dt, requires_grad=True)
    bias_t = torch.randn((nq + 2 * nkv) * d, dtype=dt, requires_grad=True) if bias else None
    kp = torch.randn(1, nkv, prefix, d, dtype=dt, requires_grad=True)
    vp = torch.randn(1, nkv, prefix, d, dtype=dt, requires_grad=True)
    keep = torch.rand(prefix + s) < 0.5
    keep[prefix + s - 1] = True
    own, pre_rows = keep[prefix:].nonzero()[:, 0], keep[:prefix].nonzero()[:, 0]

    class Source:
        got: tuple | None = None

        def prefix(self):
            return (kp.detach(), vp.detach()) if prefix else None

        def kept(self):
            return pre_rows

        def add_grad(self, dk, dv, rows=None):
            self.got = (dk, dv, rows)

    src = Source()
    y, k, v = prefix_attention(qkv, nq, nkv, cos, sin, prefix, src, bias_t)
    gy = torch.randn_like(y) * keep[prefix:, None, None]
    gk, gv = (torch.randn_like(t) * keep[prefix:][None, None, :, None] for t in (k, v))  # later chunks: kept rows
    torch.autograd.backward([y, k, v], [CompactGrad(gy.view(s, -1)[own], KeepMeta(own, s), y.shape), gk, gv])
    got = qkv.grad
    assert isinstance(got, CompactGrad)
    mine_bias = bias_t.grad.clone() if bias else None
    ref = prefix_attention_reference(qkv, nq, nkv, cos, sin, prefix, kp if prefix else None, vp, bias_t, keep)
    qkv.grad = None
    if bias:
        bias_t.grad = None
    torch.autograd.backward(list(ref), [gy, gk, gv])
    full = qkv.grad.view(s, -1)
    torch.testing.assert_close(got.rows, full[own], rtol=1e-10, atol=1e-10)
    assert full[~keep[prefix:]].abs().max() == 0 if (~keep[prefix:]).any() else True  # the rest trains nothing
    if bias:
        torch.testing.assert_close(mine_bias, bias_t.grad, rtol=1e-10, atol=1e-10)
    if prefix:
        dk, dv, rows = src.got
        assert torch.equal(rows, pre_rows)
        torch.testing.assert_close(dk, kp.grad[:, :, pre_rows], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(dv, vp.grad[:, :, pre_rows], rtol=1e-10, atol=1e-10)
        assert kp.grad[:, :, ~keep[:prefix]].abs().max() == 0  # non-kept prefix rows: no gradient in the reference


@pytest.mark.parametrize("compact", [False, True], ids=["dense", "collider"])
def test_prefix_attention_of_a_last_chunk_with_packed_documents(compact: bool) -> None:
    """A long sequence's last chunk holding short documents after its tail (decision 1233): only the tail's rows
    see (and train) the prefix, each document attends within itself at positions from 0, the tail's from the
    offset; dense and Collider's compact backward against the plain-torch reference (fp64)."""
    from megasparse.ops.compact import CompactGrad, KeepMeta
    from megasparse.ops.documents import DocSpans

    torch.manual_seed(3)
    s, prefix, nq, nkv, d, dt, head = 11, 9, 4, 2, 8, torch.float64, 4
    seg = torch.tensor([0] * head + [1] * 3 + [2] * 2 + [3] * 2)  # the tail, two documents, padding
    pos = torch.tensor([prefix + i for i in range(head)] + [0, 1, 2, 0, 1, 0, 1])
    docs = DocSpans(seg.view(-1, 1), pos.view(-1, 1))
    cos, sin = rope_tables(64, d, 10000.0, "cpu", dt)
    qkv = torch.randn(s, 1, (nq + 2 * nkv) * d, dtype=dt, requires_grad=True)
    bias_t = torch.randn((nq + 2 * nkv) * d, dtype=dt, requires_grad=True)
    kp = torch.randn(1, nkv, prefix, d, dtype=dt, requires_grad=True)
    vp = torch.randn(1, nkv, prefix, d, dtype=dt, requires_grad=True)
    keep = torch.rand(prefix + s) < (0.5 if compact else 2)
    keep[prefix + 1] = keep[prefix + head + 1] = True  # a kept tail row and a kept document row
    own, pre_rows = keep[prefix:].nonzero()[:, 0], keep[:prefix].nonzero()[:, 0]

    class Source:
        got: tuple | None = None

        def prefix(self):
            return kp.detach(), vp.detach()

        def kept(self):
            return pre_rows if compact else None

        def add_grad(self, dk, dv, rows=None):
            self.got = (dk, dv, rows)

    src = Source()
    y, k, v = prefix_attention(qkv, nq, nkv, cos, sin, prefix, src, bias_t, docs, head)
    ref = prefix_attention_reference(qkv, nq, nkv, cos, sin, prefix, kp, vp, bias_t, keep if compact else None,
                                     docs, head)  # fmt: skip
    for a, r in zip((y, k, v), ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)
    gy = torch.randn_like(y) * keep[prefix:, None, None]
    gy_in = CompactGrad(gy.view(s, -1)[own], KeepMeta(own, s), y.shape) if compact else gy
    torch.autograd.backward([y], [gy_in])  # the last chunk: no later chunk sends k/v gradients
    got = qkv.grad.rows if compact else qkv.grad
    mine_bias = bias_t.grad.clone()
    qkv.grad = bias_t.grad = None
    torch.autograd.backward([ref[0]], [gy])
    full = qkv.grad.view(s, -1)
    torch.testing.assert_close(got.view(-1, full.shape[1]), full[own], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(mine_bias, bias_t.grad, rtol=1e-10, atol=1e-10)
    dk, dv, rows = src.got
    assert (rows is None) != compact
    at = pre_rows if compact else slice(None)
    torch.testing.assert_close(dk, kp.grad[:, :, at], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dv, vp.grad[:, :, at], rtol=1e-10, atol=1e-10)
    # the mutation: every row of the chunk attending to the prefix (the documents too) gives other outputs
    alone = prefix_attention_reference(qkv, nq, nkv, cos, sin, prefix, kp, vp, bias_t, None, docs, s)[0]
    assert (alone - y).abs()[head:].amax() > 1e-3 and (alone - y).abs()[:head].amax() < 1e-10


# -- training on chunks equals training each sequence whole --------------------------------------------------------
class _Fixed:
    """A sequence source whose every step is ``seqs`` (``positions``: their ``.bin`` offsets, for a sidecar;
    ``max_length``: the longest sequence it says it may hold, which sizes a packed last chunk's padded flex keys)."""

    def __init__(self, seqs, positions=None, max_length=None):
        self.seqs, self.positions, self.max_length = seqs, positions, max_length

    def step_sequences(self, step, n):
        assert n == len(self.seqs)
        return list(enumerate(self.seqs))

    def global_positions(self, g):
        return None if self.positions is None else self.positions[g]


def _config(overrides: list[str]):
    base = tiny(**TRAINING, train__global_batch_size=len(LENGTHS), train__micro_batch_size=1)
    return load_config(None, base + ["chunkflow.enabled=true", "parallel.grad_bucket_numel=20000"] + overrides)


def _whole_sequences(
    tr, seqs, weights: dict | None = None, kept: int = 0, collider: bool = False
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every sequence alone, unchunked (its length padded to the SP shards with ignored labels): per-token losses,
    and the summed loss / real tokens backward into the buckets (``weights``: (sequence, label) -> 0 or 1, summed
    over ``kept`` tokens; ``collider``: the whole sequence's compact backward on those tokens)."""
    from megasparse.ops.compact import KeepHolder, KeepMeta

    stage, tp = tr.model.chunks[0], tr.lay.tp
    real = kept or sum(len(s) - 1 for s in seqs)
    tr.dp_opt.zero_grad(len(seqs))
    per_seq, total = [], torch.zeros((), dtype=torch.float64)
    for si, s in enumerate(seqs):
        n = -(-(len(s) - 1) // tp) * tp
        ids = torch.zeros(n, 1, dtype=torch.long)
        ids[: len(s) - 1, 0] = torch.from_numpy(s[:-1])
        targets = torch.full((n,), IGNORE, dtype=torch.long)
        targets[: len(s) - 1] = torch.from_numpy(s[1:])
        keep = KeepHolder()
        out = stage(ids.to(tr.device), targets.to(tr.device), keep).float().cpu()
        w = torch.ones_like(out)
        if weights is not None:
            w[: len(s) - 1] = torch.tensor([weights[(si, i)] for i in range(len(s) - 1)])
        if collider:
            rows = w.nonzero()[:, 0].to(tr.device)
            keep.meta = KeepMeta(rows, n, 1, seq_count=rows.numel())
        ((out * w).sum() / real).backward()
        per_seq.append(out.detach()[: len(s) - 1])
        total += out.detach().double().sum()

    tr.dp_opt.reduce()
    return per_seq, total / real


def _chunked(tr, seqs, positions=None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The trainer's ChunkFlow step on ``seqs``: per-token losses gathered per sequence (first forwards only)."""
    cf = tr.chunkflow
    cf.source = _Fixed(seqs, positions, getattr(cf.source, "max_length", None))  # the longest it was sized for
    stage, got = cf.stage, []

    class Recorder(torch.nn.Module):
        first = last = True

        def forward(self, ids, targets, keep, kv=None, docs=None):
            out = stage(ids, targets, keep, **({"kv": kv} if docs is None else {"docs": docs}))
            if kv is None or not kv.rerun:  # first forwards run group by group, chunk by chunk
                got.append(out.detach().float().cpu())
            return out

    work = cf.batches(0)
    cf.stage = Recorder()
    try:
        tr.dp_opt.zero_grad(len(work))
        loss_sum, tokens = cf(work, True, 0)
        tr.dp_opt.reduce()
    finally:
        cf.stage = stage
    per_tok = {}  # (sequence, label index) -> loss, from each chunk's real slots
    chunks = [c for group in work.groups for c in group.chunks]
    assert len(got) == len(chunks)
    for c, out in zip(chunks, got):
        _, labels, starts = chunk_arrays(c, work.sequences, cf.c)
        assert (out[torch.from_numpy(labels) == IGNORE] == 0).all()  # padding has no loss
        for p, at in zip(c.pieces, starts):
            for i in range(p.count - 1):
                per_tok[(p.seq, p.start + i)] = out[at + i]
    return per_tok, loss_sum, tokens, work


def _grads(tr) -> dict[str, torch.Tensor]:
    from megasparse.parallel.consolidate import full_state_dict

    saved = {n: p.data.clone() for n, p in tr.model.named_parameters()}
    for _, p in tr.model.named_parameters():
        p.data.copy_(p.main_grad)
    out = full_state_dict(tr.model)
    for n, p in tr.model.named_parameters():
        p.data.copy_(saved[n])
    return out


def _compare(overrides: list[str], keeps: list[int]) -> dict:
    """On this rank: whole-sequence gradients, then ChunkFlow's with each K, and one optimizer step of each."""
    from megasparse.train import Trainer

    seqs = _sequences()
    ref_tr = Trainer(_config(overrides))
    per_seq, ref_mean = _whole_sequences(ref_tr, seqs)
    out = {"ref_grads": _grads(ref_tr), "ref_mean": ref_mean.item(), "runs": {}, "chunks": 0}
    for k in keeps:
        tr = Trainer(_config(overrides + [f"chunkflow.max_chunks_in_memory={k}"]))
        per_tok, loss_sum, tokens, work = _chunked(tr, seqs)
        worst = max(abs(v.item() - per_seq[s][i].item()) / abs(per_seq[s][i].item()) for (s, i), v in per_tok.items())
        assert len(per_tok) == work.plan.loads[tr.lay.dp_rank]  # every real token of this rank's chunks
        out["chunks"] = len(work)
        out["runs"][k] = {"per_token_rel": worst, "grads": _grads(tr), "sum": loss_sum.item(), "tokens": tokens}
    # one optimizer step: the trainer's own step on chunks against the same step on whole sequences
    real = sum(len(s) - 1 for s in seqs)

    def whole_step() -> tuple[torch.Tensor, int]:
        _, mean = _whole_sequences(ref_tr, seqs)
        return (mean * real).to(ref_tr.device), real

    ref_tr.compute_gradients = whole_step
    tr.chunkflow.source = _Fixed(seqs)
    ref_tr.train_step(), tr.train_step()
    from megasparse.parallel.consolidate import full_state_dict

    out["weights"] = (full_state_dict(ref_tr.model), full_state_dict(tr.model))
    return out


def _compare_packed(kernel: str = "bias", overrides=()) -> tuple[float, float, int, int]:
    """Short sequences packed several per chunk (document attention keeps them apart, on ``kernel``), long ones
    split, K = 1 (the earlier chunks rerun); the 4-chunk sequence's last chunk also holds two short sequences
    (decision 1233). Returns the worst per-token and gradient errors, the chunks and that last chunk's pieces;
    ``overrides``: the config's (a device, a layout)."""
    from megasparse.chunkflow.step import ChunkFlowStep
    from megasparse.train import Trainer

    seqs = _sequences()
    ref_tr = Trainer(_config(list(overrides)))
    per_seq, _ = _whole_sequences(ref_tr, seqs)
    ref = _grads(ref_tr)
    tr = Trainer(_config(list(overrides)), init_groups=False)
    tr.chunkflow = ChunkFlowStep(
        tr.model,
        _Fixed(seqs, max_length=6 * C),  # the long sequence's last chunk: flex's keys padded from 4·C to 6·C
        chunk_size=C,
        per_step=len(seqs),
        keep=1,
        dp=1,
        dp_rank=0,
        device=tr.device,
        eod=0,
        doc_kernel=kernel,
        pack_tails=True,
    )
    per_tok, _, _, work = _chunked(tr, seqs)
    assert len(per_tok) == sum(len(s) - 1 for s in seqs)
    tok = max(abs(v.item() - per_seq[s][i].item()) / abs(per_seq[s][i].item()) for (s, i), v in per_tok.items())
    grads = _grads(tr)
    tail = len(work.plan.groups[0].chunks[-1].pieces)
    assert tr.chunkflow.tail_width == 6 * C
    return tok, max(_rel(grads[n], ref[n]) for n in ref), work.plan.num_chunks, tail


@pytest.mark.parametrize("kernel", ["bias", "flex", "flex-backward"])
def test_packed_chunks_with_document_attention_train_like_whole_sequences(kernel: str, monkeypatch) -> None:
    """``flex``: the packed chunks and the long sequence's packed last chunk (decision 1239) run FlexAttention's
    forward, the bias kernels' backward (CPU); ``flex-backward``: flex's own backward too, the GPU's route (torch
    refuses it on CPU only by a device check)."""
    pytest.importorskip("megasparse.ops.documents", reason="document attention (issue 30 item 1) not in this tree")
    from megasparse.ops import doc_flex, tail_flex

    calls = {"forward": 0, "backward": 0}
    widths = set()

    def counting(name: str):
        fn = getattr(tail_flex, name)

        def counted(*a, **kw):
            calls[name] += 1
            widths.add(a[-1])  # the keys' padded length (decision 1248)
            return fn(*a, **kw)

        return counted

    for name in calls:
        monkeypatch.setattr(tail_flex, name, counting(name))
    if kernel == "flex-backward":
        import torch.nn.attention.flex_attention as fa

        monkeypatch.setattr(fa, "_validate_device", lambda *a: None)
        monkeypatch.setattr(doc_flex, "has_backward", lambda q: True)
    (res,) = run_distributed(_compare_packed, 1, kernel.split("-")[0])  # world 1: in this process, patched
    tok, grad, chunks, tail = res
    assert chunks == 4 + 2 + 2 and tail == 3  # the five short sequences share two chunks and the long one's last
    assert tok < 1e-5 and grad < 1e-5, res
    layers = 4  # the packed last chunk in every layer, once (it keeps its graph: K = 1 reruns the earlier ones)
    assert calls == {"forward": layers * (kernel != "bias"), "backward": layers * (kernel == "flex-backward")}
    assert widths == ({6 * C} if kernel != "bias" else set())  # padded keys: 2·C zeros between prefix and own


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _check(res: dict, dp: int = 1, tol: float = 1e-5) -> None:
    real = sum(n - 1 for n in LENGTHS)
    for k, run in res["runs"].items():
        assert run["per_token_rel"] < tol, (k, run["per_token_rel"])
        worst = max(_rel(run["grads"][n], res["ref_grads"][n]) for n in res["ref_grads"])
        assert worst < tol, (k, worst)
        assert run["tokens"] == real / dp
    ref_w, cf_w = res["weights"]
    assert max(_rel(cf_w[n], ref_w[n]) for n in ref_w) < tol


@pytest.fixture(scope="module")
def whole() -> dict:
    """One process: whole-sequence gradients and step, and ChunkFlow's with K = 1, 2 and 4 (of 4 chunks)."""
    return run_distributed(_compare, 1, [], [1, 2, 4])[0]


def test_chunks_train_like_whole_sequences_tp1(whole: dict) -> None:
    _check(whole)
    sums = {round(r["sum"], 9) for r in whole["runs"].values()}
    assert len(sums) == 1 and abs(sums.pop() / sum(n - 1 for n in LENGTHS) - whole["ref_mean"]) < 1e-6


@pytest.mark.slow
def test_chunks_train_like_whole_sequences_tp2_sp() -> None:
    """Each TP rank's heads keep their own keys/values; the sequence-sharded activations gather for attention."""
    for r in run_distributed(_compare, 2, ["parallel.tp=2", "parallel.sequence_parallel=true"], [1, 4]):
        _check(r)


def _against_whole(grads: dict, weights: dict, whole: dict, tol: float = 1e-5) -> None:
    assert max(_rel(grads[n], whole["ref_grads"][n]) for n in whole["ref_grads"]) < tol
    ref_w = whole["weights"][0]
    assert max(_rel(weights[n], ref_w[n]) for n in ref_w) < tol


@pytest.mark.slow
def test_chunks_train_like_whole_sequences_dp2(whole: dict) -> None:
    """Ranks run different numbers of chunks (the plan deals whole groups) and the bucket hooks count each rank's
    own backward passes; the reduced gradient and the step equal one process's on all sequences."""
    res = run_distributed(_compare, 2, [], [1])
    assert res[0]["chunks"] != res[1]["chunks"]  # 5 and 6 backward passes: each rank's hooks count its own
    for r in res:
        assert r["runs"][1]["per_token_rel"] < 1e-5
        _against_whole(r["runs"][1]["grads"], r["weights"][1], whole)


def _pipeline_steps(overrides: list[str], variants: list[list[str]]) -> list[dict]:
    """ChunkFlow's gradients and one optimizer step through the pipeline, per variant of the schedule's keys (by
    default sends that never wait and tables whose backwards take 2 slots and reruns 3, so outputs wait several
    boundaries; ``chunkflow.free_sends=false``: rendezvous batches, one slot per op)."""
    from megasparse.ops.compact import densify_count
    from megasparse.parallel.consolidate import full_state_dict
    from megasparse.train import Trainer

    out = []
    for v in variants:
        tr = Trainer(_config(overrides + [o for o in v if o != PACKED]))
        rendezvous = "chunkflow.free_sends=false" in v or "filter.mode=collider" in overrides
        assert tr.chunkflow.free_sends is not rendezvous
        tr.chunkflow.source = _Fixed(_sequences())
        if PACKED in v:  # document attention on the stand-in data (its config refuses synthetic data): EOD id 0
            tr.chunkflow.eod, tr.chunkflow.pack, tr.chunkflow.pack_tails = 0, True, True
        before = densify_count()
        tr.compute_gradients()
        densified = densify_count() - before
        grads = _grads(tr)
        r = tr.train_step()
        weights = full_state_dict(tr.model)
        out.append({"grads": grads, "loss": r.loss, "weights": weights, "real": r.extra["real_tokens"]})
        out[-1]["densified"] = densified
        out[-1]["chunks"] = tr.chunkflow.last["chunks"]
    return out


PACKED = "short sequences packed, into the long one's last chunk too"  # decision 1233
PIPELINE_VARIANTS = [
    ["chunkflow.max_chunks_in_memory=1"],  # state-aware 1F1B, one long sequence per stage at a time
    ["chunkflow.max_chunks_in_memory=4", "chunkflow.sequences_in_flight=2"],  # two sequences' stores at once
    ["chunkflow.max_chunks_in_memory=1", "chunkflow.pipeline_schedule=gpipe"],  # the order before decision 1226
    ["chunkflow.max_chunks_in_memory=2", "chunkflow.sequences_in_flight=2", "chunkflow.free_sends=false"],
    ["chunkflow.max_chunks_in_memory=1", PACKED],  # 8 chunks: the 4-chunk sequence's last holds two short ones
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "overrides"),
    [(2, ["parallel.pp=2"]), (4, ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"])],
    ids=["pp2", "tp2_pp2_sp"],
)
def test_chunks_through_the_pipeline_train_like_whole_sequences(whole: dict, world: int, overrides: list[str]):
    """Long sequences' chunks and the single-chunk groups run as one slot table per stage (``chunkflow/schedule.py``:
    forwards in order, backwards in reverse, the K-bound rerun on each stage from its kept input, independent
    chunks in the long sequences' fill and drain); K = 1 and K = all 4 chunks, and the GPipe-per-group order."""
    variants = PIPELINE_VARIANTS if world == 2 else PIPELINE_VARIANTS[:2]
    for rank in run_distributed(_pipeline_steps, world, overrides, variants):
        for v, r in zip(variants, rank):
            assert abs(r["loss"] - whole["ref_mean"]) / whole["ref_mean"] < 1e-5, v
            assert r["real"] == sum(n - 1 for n in LENGTHS)
            assert r["chunks"] == (4 + 2 + 2 if PACKED in v else 4 + 2 + 5), v
            _against_whole(r["grads"], r["weights"], whole)


def _compare_filtered(
    scorer: str, mode: str = "loss_mask", keeps=(1,), pack: bool = False, overrides=(), reference: dict | None = None
) -> dict:
    """Token filtering on chunks (each K of ``keeps``; ``pack``: short sequences packed under document attention)
    against whole sequences trained on the same kept tokens: loss_mask's dense backward, or collider's compact one
    on both sides (gradients flow only among the kept tokens of each whole sequence). ``reference`` (excess):
    ``{"ngram": path}`` through the trainer's own ``filter.reference=ngram``, or ``{"sidecar": losses, "positions":
    per sequence}`` set on the step; the whole-sequence side reads the same reference for each whole sequence."""
    from megasparse.chunkflow.filter import ChunkReference, ChunkSelection
    from megasparse.chunkflow.plan import chunk_arrays as arrays_of
    from megasparse.chunkflow.step import ChunkFlowStep
    from megasparse.filtering.ngram import NgramLM
    from megasparse.filtering.reference import ReferenceLosses
    from megasparse.ops.compact import densify_count
    from megasparse.train import Trainer

    seqs, reference = _sequences(), reference or {}
    ov = [f"filter.mode={mode}", f"filter.scorer={scorer}", "filter.keep_ratio=0.5", *overrides]
    positions, whole_ref = reference.get("positions"), None
    if "ngram" in reference:  # the trainer builds it; the whole side scores each whole document
        ov += ["filter.reference=ngram", f"filter.ngram_path={reference['ngram']}"]
        lm = NgramLM.load(reference["ngram"])
        whole_ref = [torch.from_numpy(lm.stream_losses(s)[1:]).float() for s in seqs]
    elif "sidecar" in reference:  # synthetic data has no .bin: the test's losses and offsets stand in
        ov[1] = "filter.scorer=loss"
        side = reference["sidecar"]
        whole_ref = [torch.from_numpy(np.where(p[1:] >= 0, side[p[1:]], 0.0)).float() for p in positions]
    runs, ref = {}, None
    for k in keeps:
        tr = Trainer(_config(ov + [f"chunkflow.max_chunks_in_memory={k}"]), init_groups=ref is None)
        if "sidecar" in reference:
            tr.chunkflow.reference = ChunkReference(ReferenceLosses(sidecar=reference["sidecar"]))
            tr.chunkflow.selection = ChunkSelection(0.5, "excess", tr.cfg.train.seed, collider=mode == "collider")
        if pack:
            tr.chunkflow = ChunkFlowStep(
                tr.model, _Fixed(seqs), chunk_size=C, per_step=len(seqs), keep=k, dp=1, dp_rank=0, device=tr.device,
                eod=0, selection=tr.chunkflow.selection, reference=tr.chunkflow.reference, pack_tails=True,
            )  # fmt: skip
        assert (tr.chunkflow.reference is not None) == (scorer == "excess")
        before = densify_count()
        per_tok, _, _, work = _chunked(tr, seqs, positions)
        densified = densify_count() - before
        grads, sel = _grads(tr), tr.chunkflow.selection
        if ref is None:
            ref_tr = Trainer(_config(ov), init_groups=False)
            per_seq, _ = _whole_sequences(ref_tr, seqs)
            weights = {}  # the same selection, made from the whole sequences' per-token losses chunk by chunk
            for c in [c for g in work.groups for c in g.chunks]:
                _, labels, starts = arrays_of(c, seqs, C)
                out = torch.zeros(C, device=tr.device)  # (random scores: the chunk's generator is on its device)
                rc = None if whole_ref is None else torch.zeros(C)
                for p, at in zip(c.pieces, starts):
                    out[at : at + p.count - 1] = per_seq[p.seq][p.start : p.start + p.count - 1]
                    if rc is not None:
                        rc[at : at + p.count - 1] = whole_ref[p.seq][p.start : p.start + p.count - 1]
                w = sel.weights(out, labels, c, 0, rc).cpu()
                real = torch.from_numpy(labels) != IGNORE
                assert w[~real].sum() == 0  # padding is never kept
                score = out.cpu() - (0 if rc is None else rc)  # loss: the hardest; excess: the most learnable
                if scorer != "random" and w[real].sum() < real.sum():
                    assert score[real & (w == 1)].min() >= score[real & (w == 0)].max()
                for p, at in zip(c.pieces, starts):
                    for i in range(p.count - 1):
                        weights[(p.seq, p.start + i)] = w[at + i].item()
            kept = sel.kept(work.plan)
            assert sum(weights.values()) == kept
            _whole_sequences(ref_tr, seqs, weights, kept, collider=mode == "collider")
            ref = _grads(ref_tr), per_seq
        tok = max(abs(v.item() - ref[1][s][i].item()) / abs(ref[1][s][i].item()) for (s, i), v in per_tok.items())
        runs[k] = {
            "grad": max(_rel(grads[n], ref[0][n]) for n in ref[0]),
            "worst": sorted(((_rel(grads[n], ref[0][n]), n) for n in ref[0]), reverse=True)[:4],
            "tok": tok,
            "densified": densified,
            "chunks": work.plan.num_chunks,
            "last": tr.chunkflow.last,
        }
    return {"runs": runs, "kept": kept, "ref_grads": ref[0]}


def _check_filtered(res: dict, tol: float = 1e-5) -> None:
    real = sum(n - 1 for n in LENGTHS)
    for k, run in res["runs"].items():
        assert run["grad"] < tol and run["tok"] < tol, (k, run)
        assert run["densified"] == 0, (k, run)  # collider: compact from the loss to the embedding, every chunk
        assert run["last"]["real_kept_share"] == res["kept"] / real and 0.5 <= res["kept"] / real < 0.6


@pytest.mark.parametrize("scorer", ["loss", "random"])
def test_loss_mask_filtering_on_chunks_keeps_real_tokens_only(scorer: str) -> None:
    (res,) = run_distributed(_compare_filtered, 1, scorer)
    _check_filtered(res)


def test_collider_on_chunks_equals_whole_sequence_collider_tp1() -> None:
    """Collider on a 4-chunk sequence (K = 1: the earlier chunks rerun; K = 4: none does) and on packed short
    sequences (document attention; two of them in the long sequence's last chunk, whose kept rows of the short
    documents must not reach the prefix, decision 1233): the compact backward reaches the earlier chunks' kept
    keys/values only and equals collider on each whole sequence with the same kept tokens, with no densified
    gradient."""
    pytest.importorskip("megasparse.ops.documents", reason="document attention (issue 30 item 1) not in this tree")
    (res,) = run_distributed(_compare_filtered, 1, "random", "collider", (1, 4), True)
    _check_filtered(res)
    assert res["runs"][1]["chunks"] == 4 + 2 + 2  # the five short sequences share chunks and a long one's last


@pytest.mark.slow
def test_collider_on_chunks_equals_whole_sequence_collider_tp2_sp() -> None:
    """tp 2 + SP: each TP rank's heads, kept rows split over the SP shards (data-dependent counts), short sequences
    packed (two in the long one's last chunk, decision 1233; without packing: the sidecar test at tp 2 + SP)."""
    sp = ("parallel.tp=2", "parallel.sequence_parallel=true")
    for res in run_distributed(_compare_filtered, 2, "random", "collider", (1, 4), True, sp):
        _check_filtered(res)
        assert res["runs"][1]["chunks"] == 4 + 2 + 2


@pytest.mark.slow
def test_packed_last_chunk_trains_like_whole_sequences_tp2_sp() -> None:
    """The dense step with short sequences in the long one's last chunk (decision 1233) at tp 2 + SP, K = 1."""
    sp = ("parallel.tp=2", "parallel.sequence_parallel=true")
    for tok, grad, chunks, tail in run_distributed(_compare_packed, 2, "bias", sp):
        assert chunks == 8 and tail == 3 and tok < 1e-5 and grad < 1e-5, (tok, grad)


@pytest.mark.slow
def test_collider_on_chunks_tp2_pp2_sp() -> None:
    """tp 2 × pp 2 + SP through the slot tables (state-aware with one and two sequences in flight, K = 1 and K = all
    4 chunks; GPipe per group): each TP rank's heads, the kept rows split over the SP shards (data-dependent
    counts), each chunk's compact gradient crossing the stages with its own kept count (from the plan) in the
    table's order, and the first stage learning a sequence's kept rows with the gradient of its first backward;
    equals whole-sequence collider (one process), nothing densified. Packed (decision 1233): the long sequence's
    last chunk's kept count covers its short documents too, against the packed selection's reference."""
    refs = {p: run_distributed(_compare_filtered, 1, "random", "collider", (1,), p)[0] for p in (False, True)}
    layout = ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"]
    collider = ["filter.mode=collider", "filter.scorer=random", "filter.keep_ratio=0.5"]
    variants = PIPELINE_VARIANTS[:3] + [["chunkflow.max_chunks_in_memory=4"], PIPELINE_VARIANTS[4]]
    for rank in run_distributed(_pipeline_steps, 4, layout + collider, variants):
        for v, r in zip(variants, rank):
            ref = refs[PACKED in v]
            assert max(_rel(r["grads"][n], ref["ref_grads"][n]) for n in ref["ref_grads"]) < 1e-5, v
            assert r["chunks"] == (4 + 2 + 2 if PACKED in v else 4 + 2 + 5), v
            assert r["densified"] == 0, v


# -- excess-loss selection on chunks (decision 1227) ----------------------------------------------------------------
def fit_ngram(path) -> str:
    """A trigram model fitted on the step's sequences and a few more (token 0 ends a document), saved at ``path``."""
    from megasparse.filtering.ngram import NgramLM

    stream = np.concatenate(_sequences() + _sequences(seed=1))
    NgramLM.fit(stream, 250, order=3, eod_id=0).save(path)
    return str(path)


@pytest.fixture(scope="module")
def ngram_file(tmp_path_factory) -> str:
    return fit_ngram(tmp_path_factory.mktemp("ngram") / "ngram.npz")


def _sidecar() -> dict:
    """Random reference losses over a stand-in ``.bin`` holding the step's documents in another order with gaps;
    sequence 1's end-of-document was appended (offset -1, as ``SequenceDataset.positions`` marks it)."""
    rng = np.random.default_rng(7)
    at, positions = 3, [None] * len(LENGTHS)
    for i in rng.permutation(len(LENGTHS)):
        positions[i] = np.arange(at, at + LENGTHS[i])
        at += LENGTHS[i] + int(rng.integers(0, 4))
    positions[1][-1] = -1
    return {"sidecar": (rng.random(at + 2) * 6).astype(np.float32), "positions": positions}


@pytest.mark.parametrize(
    ("source", "mode", "keeps", "pack"),
    [("sidecar", "loss_mask", (1,), False), ("ngram", "loss_mask", (1,), False), ("ngram", "collider", (1, 4), True)],
    ids=["sidecar-loss_mask", "ngram-loss_mask", "ngram-collider-packed"],
)
def test_excess_on_chunks_equals_whole_sequence_excess(ngram_file, source, mode, keeps, pack) -> None:
    """Rho-1's excess loss on chunks: each chunk's labels take the reference of their whole document (the sidecar
    at their ``.bin`` offsets; the n-gram model with the document's earlier tokens as context, across chunk
    boundaries) and the kept tokens, losses and gradients equal whole sequences trained on the same selection."""
    pytest.importorskip("megasparse.ops.documents", reason="document attention (issue 30 item 1) not in this tree")
    ref = _sidecar() if source == "sidecar" else {"ngram": ngram_file}
    (res,) = run_distributed(_compare_filtered, 1, "excess", mode, keeps, pack, (), ref)
    _check_filtered(res)


@pytest.mark.slow
def test_excess_on_chunks_sidecar_collider_tp2_sp() -> None:
    """tp 2 + SP: every TP rank reads the same reference, so all agree on the kept rows."""
    sp = ("parallel.tp=2", "parallel.sequence_parallel=true")
    for res in run_distributed(_compare_filtered, 2, "excess", "collider", (1,), False, sp, _sidecar()):
        _check_filtered(res)


@pytest.mark.slow
def test_excess_on_chunks_through_the_pipeline(ngram_file) -> None:
    """pp 2: the last stage scores the reference and selects (the first stage builds none); the kept positions
    cross as under any collider scorer and the gradients equal whole-sequence excess collider (one process)."""
    (ref,) = run_distributed(_compare_filtered, 1, "excess", "collider", (1,), False, (), {"ngram": ngram_file})
    ov = ["filter.mode=collider", "filter.scorer=excess", "filter.keep_ratio=0.5", "filter.reference=ngram"]
    ov += [f"filter.ngram_path={ngram_file}", "parallel.pp=2"]
    variants = [["chunkflow.max_chunks_in_memory=1"], ["chunkflow.max_chunks_in_memory=4"]]
    for rank in run_distributed(_pipeline_steps, 2, ov, variants):
        for v, r in zip(variants, rank):
            assert max(_rel(r["grads"][n], ref["ref_grads"][n]) for n in ref["ref_grads"]) < 1e-5, v
            assert r["densified"] == 0, v


def _sidecar_on_a_corpus(ov: list[str], sidecar: str, prefix: str) -> dict:
    """The trainer's ChunkFlow step over an indexed corpus with its sidecar: each sequence's reference losses against
    the sidecar read by hand at its documents' ``.bin`` offsets, then one optimizer step."""
    from megasparse.filtering.sidecar import open_sidecar
    from megasparse.train import Trainer

    tr = Trainer(load_config(None, ov))
    cf, side = tr.chunkflow, np.asarray(open_sidecar(sidecar, prefix), dtype=np.float32)
    work, tokens = cf.batches(0), np.asarray(cf.source.indexed.tokens)
    appended = 0
    for seq, pos in zip(work.sequences, work.positions):
        on_bin = pos >= 0
        assert (tokens[pos[on_bin]] == seq[on_bin]).all()  # the offsets are the sequence's own tokens
        expect = np.where(pos[1:] >= 0, side[np.maximum(pos[1:], 0)], 0.0)
        assert np.array_equal(cf.reference.sequence(seq, pos).numpy(), expect)
        appended += int((~on_bin).sum())
    r = tr.train_step()
    return {"appended": appended, "loss": r.loss, "long": max(len(s) for s in work.sequences), "last": cf.last}


def test_excess_on_chunks_reads_the_sidecar_of_the_corpus(corpus) -> None:  # noqa: F811  (the fixture)
    """Through ``megasparse train``'s own wiring: the sidecar of an indexed corpus (documents without a final EOD:
    the appended one has no ``.bin`` offset and reference 0) at each whole sequence's offsets, and a step trains."""
    ov = overrides(corpus, "sidecar", ["train.micro_batch_size=1", "chunkflow.enabled=true", "filter.keep_ratio=0.5"])
    (res,) = run_distributed(_sidecar_on_a_corpus, 1, ov, corpus["sidecar"], corpus["prefix"])
    assert res["appended"] == 8 and res["long"] > C + 1 and np.isfinite(res["loss"])
    assert 0.5 <= res["last"]["real_kept_share"] < 0.6


def test_ngram_reference_of_a_later_chunk_is_the_whole_documents(ngram_file) -> None:
    """A long sequence's later chunk scores its labels with the document's earlier tokens as n-gram context (what
    scoring the whole document alone gives); the chunk's own tokens as the context (the mutation) would differ."""
    from megasparse.chunkflow.filter import ChunkReference
    from megasparse.filtering.ngram import NgramLM
    from megasparse.filtering.reference import ReferenceLosses

    lm = NgramLM.load(ngram_file)
    ref = ChunkReference(ReferenceLosses(ngram=lm))
    seqs = _sequences()
    plan = plan_step([len(s) for s in seqs], C, 1, pack=True, tails=False)  # the last chunk: the tail and padding
    long = next(g for g in plan.groups if len(g.chunks) == 4)
    seq = long.chunks[0].pieces[0].seq
    whole = torch.from_numpy(lm.stream_losses(seqs[seq])[1:]).float()
    scored = {seq: ref.sequence(seqs[seq], None)}
    for c in long.chunks[1:]:
        p = c.pieces[0]
        got = ChunkReference.chunk(c, scored, C)
        torch.testing.assert_close(got[: p.count - 1], whole[p.start : p.start + p.count - 1], rtol=0, atol=0)
        assert (got[p.count - 1 :] == 0).all()  # padding
        tokens = torch.from_numpy(chunk_arrays(c, seqs, C)[0])
        alone = ReferenceLosses(ngram=lm)(tokens[:-1], tokens[1:])  # the mutation: the chunk scored on its own
        assert not torch.allclose(alone[:2], got[:2])  # the chunk's first labels lose their real context


# -- the pipeline schedule (pure Python) -------------------------------------------------------------------------------
def _random_sizes(rng: np.random.Generator) -> tuple[int, ...]:
    """Chunks per group of a long-tail step: mostly independent chunks, some sequences of 2-12 chunks."""
    m = int(rng.integers(1, 14))
    return tuple(int(rng.integers(2, 13)) if rng.random() < 0.3 else 1 for _ in range(m))


def test_pipeline_schedules_pair_every_transfer_and_keep_the_order() -> None:
    """On many random long-tail plans (pp 2-4, K 1-12; tables of one slot per op, or 1, 2, 1 for F, B, rerun):
    every boundary's sends meet their receives in the same order on both ends and no stage waits forever; (a)-(c)
    hold (``simulate`` raises otherwise); the state-aware table idles no more than the GPipe-per-group order, in
    table slots and in the stages' own clocks (B = 2F; rendezvous transfers for the one-slot tables, sends that
    never wait for the 1, 2, 1 ones, as the executor pairs them), and its activations stay within K per
    sequence plus 1F1B's pp − r independent chunks per stage, with two sequences in flight too (decision 1249)."""
    from megasparse.chunkflow.schedule import COST, UNIT, gpipe_per_group, simulate, state_aware

    rng = np.random.default_rng(30)
    fewer = 0
    for i in range(300):
        pp, keep, sizes = int(rng.integers(2, 5)), int(rng.integers(1, 13)), _random_sizes(rng)
        cost = COST if i % 2 else UNIT
        waits = cost == UNIT  # the executor's two pairings: rendezvous with one slot per op, free sends with COST
        old = simulate(gpipe_per_group(pp, sizes, keep, cost), sends_wait=waits)
        for window in (1, 2):
            new = simulate(state_aware(pp, sizes, keep, window, cost), sends_wait=waits)
            assert new.idle <= old.idle and new.time <= old.time, (pp, sizes, keep, window, cost, old, new)
            seq = max([min(keep, n) for n in sizes if n > 1], default=0)
            singles = sizes.count(1)
            assert all(new.peak_graphs[r] <= seq + min(pp - r, singles) for r in range(pp)), new
        fewer += new.idle < old.idle
    assert fewer > 150  # and usually strictly fewer


def test_pipeline_simulator_catches_a_broken_table() -> None:
    """Swapping two backwards of one sequence, or two forwards on one stage only (the link then disagrees), or a
    table whose kept positions (collider) do not cross with a sequence's first backward, fails."""
    from dataclasses import replace

    from megasparse.chunkflow.schedule import Schedule, simulate, state_aware

    class Unkept(Schedule):
        def opens(self, c) -> bool:
            return False

    good = state_aware(2, (3, 1, 1), 3)
    simulate(good)
    rows = [list(r) for r in good.slots]
    b = [t for t, op in enumerate(rows[0]) if op is not None and op[0] == "B" and op[1][0] == 0]
    rows[0][b[0]], rows[0][b[1]] = rows[0][b[1]], rows[0][b[0]]
    with pytest.raises(AssertionError, match="before"):
        simulate(replace(good, slots=tuple(tuple(r) for r in rows)))
    rows = [list(r) for r in good.slots]
    f = [t for t, op in enumerate(rows[1]) if op is not None and op[0] == "F"]
    rows[1][f[2]], rows[1][f[3]] = rows[1][f[3]], rows[1][f[2]]
    with pytest.raises(AssertionError):
        simulate(replace(good, slots=tuple(tuple(r) for r in rows)))
    with pytest.raises(AssertionError, match="before its kept positions"):
        simulate(Unkept(good.pp, good.sizes, good.keep, good.slots))


def test_state_aware_fills_a_long_sequences_bubbles_with_independent_chunks() -> None:
    """The tests' step (a 4-chunk and a 2-chunk sequence, five single chunks) at pp 2, and a long-tail step of 64
    sequences (decision 1226's numbers): independent chunks run inside a long sequence's span on stage 0."""
    from megasparse.chunkflow.schedule import gpipe_per_group, simulate, state_aware

    sizes = tuple(len(g.chunks) for g in plan_step(LENGTHS, C, dp=1, pack=False).groups)
    table = state_aware(2, sizes, 1)
    order = table.order(0)
    span = [i for i, (_, c) in enumerate(order) if c[0] == 0]
    assert any(table.sizes[c[0]] == 1 for _, c in order[span[0] : span[-1]])
    assert simulate(table).idle < simulate(gpipe_per_group(2, sizes, 1)).idle
    src = LongTailSequences(vocab=100, max_length=32 * 1024, seed=3)
    lengths = [src.length(g) for g in range(64)]
    plan = plan_step(lengths, 1024, dp=1, tails=False)  # the packed chunks as decision 1226 counted them
    sizes = tuple(len(g.chunks) for g in plan.groups)
    packed = tuple(len(g.chunks) for g in plan_step(lengths, 1024, dp=1).groups)  # short ones in tails (1233)
    for pp in (2, 4):
        old, new, two = (simulate(f(pp, sizes, 1)) for f in (gpipe_per_group, state_aware, _two_in_flight))
        assert two.idle < new.idle < old.idle, (pp, old.idle, new.idle, two.idle)
        # fewer independent chunks fill the bubbles once short documents go into tails, but the step still
        # shortens: every chunk it saves is work on every stage (simulated: 589 -> 558 at pp 2, 842 -> 830 at pp 4)
        assert simulate(state_aware(pp, packed, 1)).time < new.time


def _two_in_flight(pp: int, sizes: tuple[int, ...], keep: int):
    from megasparse.chunkflow.schedule import state_aware

    return state_aware(pp, sizes, keep, window=2)


# -- memory follows K -------------------------------------------------------------------------------------------------
def _saved_peak(n_chunks: int, keep: int) -> int:
    from megasparse.chunkflow.step import ChunkFlowStep
    from megasparse.train import Trainer

    tr = Trainer(_config([]))
    seqs = _sequences([n_chunks * C + 1])
    step = ChunkFlowStep(tr.model, _Fixed(seqs), chunk_size=C, per_step=1, keep=keep, dp=1, dp_rank=0, device=tr.device)
    live, peak = [0, 0], [0, 0]  # saved tensors, their bytes

    stage = tr.model.chunks[0]

    class Held:
        def __init__(self, t):
            tables = {x.untyped_storage().data_ptr() for x in (stage.rope_cos, stage.rope_sin)}
            shared = t.untyped_storage().data_ptr() in tables  # the RoPE tables: one copy, grown to the length
            self.t, self.bytes = t, 0 if shared else t.numel() * t.element_size()
            live[0] += 1
            live[1] += self.bytes
            peak[0], peak[1] = max(peak[0], live[0]), max(peak[1], live[1])

        def __del__(self):
            live[0] -= 1
            live[1] -= self.bytes

    work = step.batches(0)
    tr.dp_opt.zero_grad(len(work))
    with torch.autograd.graph.saved_tensors_hooks(Held, lambda h: h.t):
        step(work, True, 0)
    assert live == [0, 0]
    return tuple(peak)


def test_saved_activations_follow_k_not_the_chunk_count() -> None:
    def peaks():
        return {(n, k): _saved_peak(n, k) for n in (2, 5) for k in (1, 2, 5)}

    (p,) = run_distributed(peaks, 1)
    # K fixed: as many saved tensors and bytes at 5 chunks as at 2 (the K/V store is not an activation: it is the
    # sequence's state, decision 1220)
    assert p[(2, 1)] == p[(5, 1)] and p[(2, 2)] == p[(5, 2)], p
    assert p[(5, 1)][0] < p[(5, 2)][0] < p[(5, 5)][0]  # and each kept chunk costs its activations
    assert p[(5, 5)][1] > p[(2, 5)][1] > p[(2, 1)][1]


# -- the config -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["chunkflow.max_chunks_in_memory=0"], "max_chunks_in_memory=0 must be >= 1"),
        (["train.micro_batch_size=2"], "set train.micro_batch_size=1"),
        (["parallel.pp=2", "parallel.virtual_stages=2", "train.global_batch_size=4"], "parallel.virtual_stages > 1"),
        (["parallel.pp=2", "loss.vocab_over_pp=true"], "loss.vocab_over_pp"),
        (["filter.mode=loss_mask", "filter.scorer=excess", "filter.reference=model"], "sidecar .* or use filter.refe"),
        (["filter.mode=collider", "filter.scorer=excess", "filter.reference=sidecar"], None),
        (["filter.mode=loss_mask", "filter.scorer=excess", "filter.reference=ngram"], None),
        (["model.recompute=full"], "model.recompute=full"),
        (["chunkflow.max_sequence_length=1"], "max_sequence_length=1 must be >= 2"),
        (["chunkflow.pipeline_schedule=zb"], "use state_aware or gpipe"),
        (["chunkflow.sequences_in_flight=0"], "sequences_in_flight=0 must be >= 1"),
        (
            ["model.rope_scaling=llama3", "model.rope_original_max_positions=64", "chunkflow.max_sequence_length=1024"],
            "the 512 positions",
        ),
        (["chunkflow.chunk_size=32"], "differs from model.seq_length=16"),
        (["train.global_batch_size=1", "chunkflow.chunk_size=16", "train.cuda_graphs=true"], None),
        (["filter.mode=collider", "filter.scorer=random"], None),
    ],
)
def test_bad_chunkflow_configs_are_one_line(overrides: list[str], match: str | None) -> None:
    cfg = load_config(None, tiny(train__micro_batch_size=1) + ["chunkflow.enabled=true"] + overrides)
    if match is None:
        assert cfg.validate(1) == 1
        return
    world = 2 if "parallel.pp=2" in overrides else 1
    with pytest.raises(ConfigError, match=match) as e:
        cfg.validate(world)
    assert "\n" not in str(e.value)


def test_chunkflow_runs_eagerly_and_says_why() -> None:
    """``train.cuda_graphs`` (on by default) is no error: the chunks run eagerly and the banner's graphs line says
    why (the DP buckets then overlap from their hooks)."""
    from megasparse.cudagraph import capture_blocker
    from megasparse.step.build import components_for_capture_check

    for pp in (1, 2):
        cfg = load_config(None, tiny(train__micro_batch_size=1) + ["chunkflow.enabled=true", f"parallel.pp={pp}"])
        why = capture_blocker(cfg, pp, torch.device("cuda", 0), components_for_capture_check(cfg))
        assert why is not None and "chunkflow.enabled" in why


def test_pack_tails_is_one_flag_away() -> None:
    """``chunkflow.pack_tails`` (decision 1233) reaches the trainer's step: true (with document attention) short
    sequences fill long sequences' last chunks and the fill rises; false, each long sequence pads its last chunk.
    null, the default (decision 1248), packs them where those chunks run FlexAttention: flex, or auto on CUDA at
    bf16/fp16; here on CPU (auto: the bias kernels) it does not."""
    from types import SimpleNamespace

    from megasparse.chunkflow.config import chunkflow_line, tails_on_flex, tails_packed
    from megasparse.chunkflow.step import chunk_step

    assert load_config(None, tiny()).chunkflow.pack_tails is None
    fills = {}
    for tails in (True, False, None):
        ov = ["chunkflow.enabled=true", "data.document_attention=true"]
        ov += [] if tails is None else [f"chunkflow.pack_tails={str(tails).lower()}"]
        cfg = load_config(None, tiny(train__micro_batch_size=1, train__global_batch_size=64) + ov)
        on = bool(tails) or (tails is None and tails_packed(cfg, cuda=False))
        assert ("last chunks" in chunkflow_line(cfg, tails_packed(cfg, cuda=False))) == on
        step = chunk_step(cfg, SimpleNamespace(chunks=[None]), 250, 1, 0, torch.device("cpu"))
        plan = step.batches(0).plan
        assert any(len(g.chunks) > 1 and len(g.chunks[-1].pieces) > 1 for g in plan.groups) == on
        fills[tails] = plan.real_tokens / plan.slots
    assert fills[True] > fills[False] == fills[None]
    # null resolves by where the packed last chunk's attention runs
    cfg = load_config(None, tiny() + ["chunkflow.enabled=true", "data.document_attention=true"])
    assert tails_packed(cfg, cuda=True, half=True) and not tails_packed(cfg, cuda=True, half=False)
    assert not tails_packed(cfg, cuda=False, half=True) and tails_on_flex(cfg, cuda=True, half=True)
    flex = load_config(None, tiny() + ["chunkflow.enabled=true", "data.document_attention=true",
                                       "data.document_attention_kernel=flex"])  # fmt: skip
    assert tails_packed(flex, cuda=False, half=False)
    bias = load_config(None, tiny() + ["chunkflow.enabled=true", "data.document_attention=true",
                                       "data.document_attention_kernel=bias"])  # fmt: skip
    assert not tails_packed(bias, cuda=True, half=True)
    assert not tails_packed(load_config(None, tiny() + ["chunkflow.enabled=true", "chunkflow.pack_tails=true"]))


def test_free_sends_pick_the_tables_costs_and_stay_off_under_collider() -> None:
    """``chunkflow.free_sends`` (decision 1249): on under pp > 1 by default, with tables built in ``COST``'s
    proportions; off at pp 1, when asked, and under collider, whose compact gradients need the rendezvous batches;
    the banner says which."""
    from megasparse.chunkflow.config import chunkflow_line, frees_sends
    from megasparse.chunkflow.schedule import COST, UNIT
    from megasparse.chunkflow.step import pipeline_schedule

    on = _config(["parallel.pp=2"])
    assert frees_sends(on) and "sends that never wait" in chunkflow_line(on, False)
    for off in (["parallel.pp=1"], ["parallel.pp=2", "chunkflow.free_sends=false"],
                ["parallel.pp=2", "filter.mode=collider", "filter.scorer=random"]):  # fmt: skip
        cfg = _config(off)
        assert not frees_sends(cfg), off
        assert off == ["parallel.pp=1"] or "rendezvous transfers" in chunkflow_line(cfg, False)
    sizes = (3, 1, 2, 1)
    assert pipeline_schedule(on.chunkflow, True)(2, sizes, 1).cost == COST
    assert pipeline_schedule(on.chunkflow, False)(2, sizes, 1).cost == UNIT
    gpipe = _config(["parallel.pp=2", "chunkflow.pipeline_schedule=gpipe"]).chunkflow
    assert pipeline_schedule(gpipe, True)(2, sizes, 1).cost == COST
