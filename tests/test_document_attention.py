"""Document-aware attention (``data.document_attention``, decision 1200).

Op level: ``ops/attention.py`` with ``DocSpans`` against an fp64 masked reference, forward, dense backward and the
compact (Collider) backward, on odd shapes. Model level: a packed window trains exactly like each of its documents
run alone from position 0 (tp 1, and tp 2 × pp 2 + SP on gloo; with and without collider).
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from distributed import free_port, run_distributed
from tiny import tiny

from megasparse.data.dataset import SyntheticData
from megasparse.ops.attention import attention, rope_tables
from megasparse.ops.compact import CompactGrad, KeepMeta
from megasparse.ops.documents import DocSpans, reference_attention
from megasparse.ops.rope_kernels import rope_reference

EOD = 7


def test_spans_of_a_window():
    """The EOD belongs to the document it ends; the token after it starts a new one at position 0."""
    ids = torch.tensor([[1, 2, EOD, 3, EOD, EOD, 4], [EOD, 5, 5, 5, 5, 5, EOD]]).t()
    docs = DocSpans.from_ids(ids, EOD)
    assert docs.segments.t().tolist() == [[0, 0, 0, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]
    assert docs.positions.t().tolist() == [[0, 1, 2, 0, 1, 0, 0], [0, 0, 1, 2, 3, 4, 5]]
    allowed = docs.allowed()[0, 0]
    assert allowed[4].tolist() == [False, False, False, True, True, False, False]
    assert allowed[2].tolist() == [True, True, True, False, False, False, False]


def window_ids(s: int, b: int, gen: torch.Generator) -> torch.Tensor:
    """[s, b] ids with different boundaries per sequence: several documents; none; EOD first and last."""
    ids = torch.randint(10, 50, (s, b), generator=gen)
    ids[[3, 4, 9], 0] = EOD  # several documents, one of a single token (the EOD at 4)
    if b > 2:
        ids[[0, s - 1], 2] = EOD  # a one-token document at the start, an EOD as the last token
    return ids  # sequence 1 (b > 1): one document crossing nothing


SHAPES = [  # (s, b, nq, nkv, d)
    (13, 3, 4, 2, 8),
    (11, 1, 3, 1, 16),
]
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def reference(qkv: torch.Tensor, ids: torch.Tensor, nq: int, nkv: int, keep: torch.Tensor | None = None):
    """fp64 attention of qkv [s, b, (nq+2nkv)d] within documents, RoPE at document positions; with ``keep``
    [s, b] bool the Collider semantics (filtered keys, values and score columns stop-gradient)."""
    s, b, w = qkv.shape
    d = w // (nq + 2 * nkv)
    docs = DocSpans.from_ids(ids, EOD)
    cos, sin = rope_tables(s, d, 10000.0, "cpu", torch.float64)
    heads = qkv.view(s, b, nq + 2 * nkv, d).permute(1, 2, 0, 3)
    pos = docs.positions.t()
    q = rope_reference(heads[:, :nq], cos, sin, pos)
    k = rope_reference(heads[:, nq : nq + nkv], cos, sin, pos)
    v = heads[:, nq + nkv :]
    allowed = docs.allowed()
    if keep is None:
        out = reference_attention(q, k, v, allowed, d**-0.5)
    else:
        kk = keep.t()[:, None, :, None]
        k, v = torch.where(kk, k, k.detach()), torch.where(kk, v, v.detach())
        g = nq // nkv
        scores = (q @ k.repeat_interleave(g, 1).transpose(-1, -2)) * d**-0.5
        col = keep.t()[:, None, None, :]
        scores = torch.where(col, scores, scores.detach()).masked_fill(~allowed, float("-inf"))
        out = scores.softmax(-1) @ v.repeat_interleave(g, 1)
    return out.permute(2, 0, 1, 3).reshape(s, b, nq * d)


def inputs(shape, dtype, seed=0):
    s, b, nq, nkv, d = shape
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(s, b, (nq + 2 * nkv) * d, generator=gen, dtype=torch.float64)
    gout = torch.randn(s, b, nq * d, generator=gen, dtype=torch.float64)
    cos, sin = rope_tables(s, d, 10000.0, "cpu")
    return qkv, gout, cos, sin, window_ids(s, b, gen)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("recompute", [False, True])
def test_dense_forward_backward_match_reference(shape, dtype, recompute):
    s, b, nq, nkv, d = shape
    qkv, gout, cos, sin, ids = inputs(shape, dtype)
    x = qkv.to(dtype).requires_grad_()
    y = attention(x, nq, nkv, cos, sin, recompute, docs=DocSpans.from_ids(ids, EOD))
    y.backward(gout.to(dtype))
    xr = qkv.clone().requires_grad_()
    yr = reference(xr, ids, nq, nkv)
    yr.backward(gout)
    assert rel(y, yr) < TOL[dtype]
    assert rel(x.grad, xr.grad) < TOL[dtype]
    # documents really change the result: plain causal attention differs
    plain = attention(qkv.to(dtype), nq, nkv, cos, sin)
    assert rel(plain, yr) > 10 * TOL[dtype]


def kept_rows(s: int, b: int, counts: list[int], gen: torch.Generator) -> torch.Tensor:
    """Flat kept rows (position·b + sequence, ascending) with ``counts[j]`` random positions of sequence j."""
    rows = [torch.randperm(s, generator=gen)[:c] * b + j for j, c in enumerate(counts)]
    return torch.cat(rows).sort().values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("shape", "counts", "static"),
    [
        (SHAPES[0], [5, 9, 2], False),  # padded per sequence (data-dependent counts)
        (SHAPES[0], [6, 6, 6], True),  # balanced selection: static counts, no padding
        (SHAPES[1], [7], True),  # one sequence: the in-order path
    ],
)
def test_compact_backward_matches_collider_reference(shape, counts, static, dtype):
    s, b, nq, nkv, d = shape
    qkv, gout, cos, sin, ids = inputs(shape, dtype, seed=1)
    idx = kept_rows(s, b, counts, torch.Generator().manual_seed(2))
    meta = KeepMeta(idx, s * b, batch=b, seq_count=counts[0] if static else None)
    x = qkv.to(dtype).requires_grad_()
    y = attention(x, nq, nkv, cos, sin, docs=DocSpans.from_ids(ids, EOD))
    g_rows = gout.reshape(s * b, -1)[idx].to(dtype)
    y.backward(CompactGrad(g_rows, meta, y.shape))
    keep = torch.zeros(s * b, dtype=torch.bool)
    keep[idx] = True
    keep = keep.view(s, b)
    xr = qkv.clone().requires_grad_()
    yr = reference(xr, ids, nq, nkv, keep)
    yr.backward(gout * keep[..., None])
    got = x.grad
    assert isinstance(got, CompactGrad)
    assert rel(got.rows, xr.grad.reshape(s * b, -1)[idx]) < TOL[dtype]


# -- model level: a packed window equals its documents run alone ---------------------------------------------------

VOCAB, DOC_EOD = 250, 249
MODEL = tiny(
    data__prefix="packed-documents",  # build_data is replaced in the worker (DocumentData below)
    data__document_attention="true",
    model__num_layers=4,
    train__global_batch_size=4,
    filter__scorer="random",
    filter__granularity="microbatch",
)
COLLIDER = ["filter.mode=collider", "filter.keep_ratio=0.6"]


def document_sample(g: int, seq: int) -> torch.Tensor:
    """Sample g of the stream: seq + 1 random tokens with 0–3 EODs at seeded places; every fifth sample ends its
    input with an EOD (the label after it starts the next document)."""
    gen = torch.Generator().manual_seed(1000 + g)
    tok = torch.randint(0, DOC_EOD, (seq + 1,), generator=gen)
    tok[torch.randperm(seq + 1, generator=gen)[: g % 4]] = DOC_EOD
    if g % 5 == 0:
        tok[seq - 1] = DOC_EOD
    return tok


class DocumentData(SyntheticData):
    """The synthetic stream with documents (``document_sample``) and the EOD id a packed dataset carries."""

    eod_id = DOC_EOD

    def global_sample(self, g: int, seed: int | None = None) -> torch.Tensor:
        return document_sample(g, self.seq)


@contextmanager
def packed_documents():
    """The trainer reads ``DocumentData`` (its ``build_data`` replaced while inside)."""
    import megasparse.train as train_mod

    def build_data(cfg):
        seq = cfg.model.seq_length
        return DocumentData(VOCAB, seq, 0), DocumentData(VOCAB, seq, 1, n=16), VOCAB

    saved = train_mod.build_data
    train_mod.build_data = build_data
    try:
        yield
    finally:
        train_mod.build_data = saved


def packed_run(runs: list[list[str]]) -> list[dict]:
    """Each run's per-token losses (last stage, per micro-batch) and gradients, with the data above."""
    from megasparse.config import load_config
    from megasparse.ops.compact import densify_count
    from megasparse.parallel import state
    from megasparse.parallel.consolidate import full_state_dict
    from megasparse.train import Trainer

    out = []
    with packed_documents():
        for n, overrides in enumerate(runs):
            tr = Trainer(load_config(None, MODEL + overrides), init_groups=n == 0)
            ms, per_token = tr.forward_backward.step, []
            plain_loss = ms.loss

            def loss(values, batch, keep, i, plain_loss=plain_loss, per_token=per_token):
                per_token.append(values.detach().clone())
                return plain_loss(values, batch, keep, i)

            ms.loss = loss
            before = densify_count()
            tr.compute_gradients()
            lay = state.layout()
            out.append(
                {
                    "grads": full_state_dict(tr.model, grads=True),
                    "weights": full_state_dict(tr.model),
                    "per_token": per_token if lay.is_last_stage else None,
                    "tp_rank": lay.tp_rank,
                    "kept_rows": tr.filter.kept_rows if tr.filter is not None else 0,
                    "num_mb": tr.num_mb,
                    "densified": densify_count() - before,
                }
            )
    return out


def documents_alone(res: dict, collider: bool, sp: int) -> tuple[list[torch.Tensor], dict]:
    """Per-token losses [s, b] per micro-batch and gradients of the plain reference model run on each document
    alone (its own sequence, positions from 0), with the same (random) kept tokens under collider."""
    from reference_model import per_token_loss

    from megasparse.config import load_config
    from megasparse.filtering.selection import select_tokens

    cfg = load_config(None, MODEL)
    s, mb = cfg.model.seq_length, cfg.train.micro_batch_size
    params = {k: v.clone().requires_grad_() for k, v in res["weights"].items()}
    losses, total = [], 0.0
    for j in range(res["num_mb"]):
        tok = torch.stack([document_sample(j * mb + i, s) for i in range(mb)])
        ids, tgt = tok[:, :-1].t(), tok[:, 1:].t()
        keep = torch.ones(s, mb, dtype=torch.bool)
        if collider:  # the trainer's random scores of micro-batch j (filtering/component.py)
            gen = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + j)
            keep = select_tokens(torch.rand(ids.shape, generator=gen), 0.6, "microbatch", sp_size=sp).mask
        per = torch.zeros(s, mb, dtype=torch.float32)
        for col in range(mb):
            ends = [int(p) + 1 for p in (ids[:, col] == DOC_EOD).nonzero()] + [s]
            start = 0
            for end in sorted(set(ends)):
                if end > start:
                    sl = slice(start, end)
                    doc_keep = keep[sl, col : col + 1] if collider else None
                    loss = per_token_loss(
                        params, cfg.model, VOCAB, ids[sl, col : col + 1], tgt[sl, col : col + 1], doc_keep
                    )
                    per = per.index_put((torch.arange(start, end), torch.tensor(col)), loss[:, 0])
                start = end
        losses.append(per.detach())
        total = total + (per * keep).sum()
    norm = res["kept_rows"] * res["num_mb"] if collider else res["num_mb"] * mb * s
    (total / norm).backward()
    return losses, {k: (p.grad if p.grad is not None else torch.zeros_like(p)) for k, p in params.items()}


def assert_documents_alone(results: list[dict], collider: bool, sp: int = 1) -> None:
    """The last stage's per-token losses (SP shards in TP-rank order) and the gradients match the reference."""
    res = results[0]
    ref_losses, ref_grads = documents_alone(res, collider, sp)
    last = sorted((r for r in results if r["per_token"] is not None), key=lambda r: r["tp_rank"])
    for j, ref in enumerate(ref_losses):
        parts = [r["per_token"][j] for r in last]
        got = torch.cat(parts) if parts[0].numel() < ref.numel() else parts[0]
        assert ((got.view_as(ref) - ref).norm() / ref.norm()).item() < 1e-5, j
    for k, ref in ref_grads.items():
        err = ((res["grads"][k] - ref).norm() / ref.norm().clamp_min(1e-20)).item()
        assert err < 1e-5, (k, err)
    assert all(r["densified"] == 0 for r in results)


def test_packed_window_equals_documents_alone_tp1():
    """Also under activation recompute: the full layer checkpoint reruns the blocks with the same spans."""
    runs = [[], COLLIDER, ["model.recompute=full"] + COLLIDER, ["model.recompute=selective"]]
    dense, collider, full, selective = run_distributed(packed_run, 1, runs)[0]
    assert_documents_alone([dense], False)
    assert_documents_alone([collider], True)
    assert_documents_alone([full], True)
    assert_documents_alone([selective], False)


def test_synthetic_data_has_no_documents():
    from megasparse.config import load_config
    from megasparse.configbase import ConfigError

    with pytest.raises(ConfigError, match="synthetic data .* has no documents"):
        load_config(None, tiny(data__document_attention="true")).validate(1)


@pytest.mark.slow
def test_packed_window_equals_documents_alone_tp2_pp2_sp():
    """TP 2 × PP 2 + SP on gloo: attention sees the whole window under SP, every stage builds the same spans."""
    layout = ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"]
    runs = run_distributed(packed_run, 4, [layout, layout + COLLIDER])
    assert_documents_alone([r[0] for r in runs], False)
    assert_documents_alone([r[1] for r in runs], True, sp=2)


@pytest.mark.slow
def test_packed_window_equals_documents_alone_pp2_vocab_and_virtual_stages():
    """pp 2 with the vocabulary over the pipeline (embedding too: the first stage's input comes embedded, the spans
    still from the ids) and with virtual stages (each chunk builds its spans)."""
    vocab = ["parallel.pp=2", "loss.vocab_over_pp=true", "loss.embedding_over_pp=true"]
    runs = [vocab, vocab + COLLIDER, ["parallel.pp=2", "parallel.virtual_stages=2"]]
    res = run_distributed(packed_run, 2, runs)
    for n, collider in enumerate([False, True, False]):
        assert_documents_alone([r[n] for r in res], collider)


def test_benchmark_small_runs(tmp_path):
    """benchmarks/bench_document_attention.py --small: the script the lead runs on a GPU, on tiny CPU shapes."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    out = tmp_path / "bench.json"
    script = root / "benchmarks" / "bench_document_attention.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--small", "--out", str(out)], cwd=root, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    cases = json.loads(out.read_text())["cases"]
    assert [c["mix"] for c in cases] == ["fixed", "lognormal"]
    for case in cases:
        assert case["documents"] > 1 and case["attn_flex_ms"] > 0 and case["block_mask_ms"] > 0
        assert "overhead_flex_pct" in case and "overhead_bias_pct" in case
    assert proc.stdout.strip().splitlines()[-1].lstrip().startswith("160")  # the table comes last


def _scores_worker() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from megasparse.config import load_config
    from megasparse.model.builder import InferenceModel
    from megasparse.train import Trainer

    with packed_documents():
        tr = Trainer(load_config(None, MODEL), init_groups=True)
    gen = torch.Generator().manual_seed(3)
    first = torch.randint(0, DOC_EOD, (5,), generator=gen)
    first[-1] = DOC_EOD
    second = torch.randint(0, DOC_EOD, (11,), generator=gen)
    window = torch.cat([first, second]).view(-1, 1)
    scorer, plain = InferenceModel(tr.model, eod=DOC_EOD), InferenceModel(tr.model)
    return scorer.token_losses(window), plain.token_losses(window), scorer.token_losses(second.view(-1, 1))


def test_reference_scores_follow_document_attention():
    """``ref score`` and the online reference model score a token within its own document when the run trains
    with document attention: the second document of a window scores as it does alone (its first token is
    predicted from the first document's EOD, which belongs to that document)."""
    docs, plain, alone = run_distributed(_scores_worker, 1)[0]
    torch.testing.assert_close(docs[6:], alone[1:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(docs[:5], plain[:5], rtol=1e-5, atol=1e-6)  # the first document: nothing before it
    assert (plain[6:] - alone[1:]).abs().max() > 1e-3  # without the mask the context leaks across the EOD
