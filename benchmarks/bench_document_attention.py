"""What document-aware attention (``data.document_attention``, decision 1200) costs against plain causal attention,
on Llama-3-8B-shaped layers, one GPU.

    python benchmarks/bench_document_attention.py [--seq 4096,8192] [--micro 1] [--doc-len 512] \
        [--out runs/bench_document_attention.json]

For each length: the attention op alone, forward + backward (bf16, 32 query / 8 key-value heads of 128), plain
causal and with documents (the spans built from ids with an EOD about every ``--doc-len`` tokens, the bias mask,
the masked kernels), then a transformer block's forward + backward with and without documents. ``overhead_pct`` is
the block's extra time with documents: issue 30 asks for at most 5%. ``kernel`` says which masked kernel ran
(``cudnn``, or ``efficient`` when cuDNN refused the bias: the warning says why). ``--small`` runs tiny shapes on
the CPU (the smoke test's mode; its times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megasparse.model.config import ModelConfig  # noqa: E402
from megasparse.model.gpt import TransformerBlock  # noqa: E402
from megasparse.ops import attention as attn  # noqa: E402
from megasparse.ops.documents import DocSpans  # noqa: E402
from megasparse.parallel import state  # noqa: E402

EOD = 0


def timed(fn, reps: int, device: torch.device) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs after one warm-up."""
    times = []
    for i in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(cfg: ModelConfig, seq: int, micro: int, doc_len: int, device: torch.device, dtype, reps: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 1000, (seq, micro), generator=gen)
    ids[torch.rand(seq, micro, generator=gen) < 1.0 / doc_len] = EOD
    ids = ids.to(device)
    cos, sin = attn.rope_tables(seq, cfg.head_dim, cfg.rope_theta, device)
    nq, nkv, d = cfg.num_attention_heads, cfg.kv_heads, cfg.head_dim
    qkv = torch.randn(seq, micro, (nq + 2 * nkv) * d, device=device, dtype=dtype, requires_grad=True)
    g_attn = torch.randn(seq, micro, nq * d, device=device, dtype=dtype)

    def op(docs: bool):
        spans = DocSpans.from_ids(ids, EOD) if docs else None
        attn.attention(qkv, nq, nkv, cos, sin, docs=spans).backward(g_attn)

    block = TransformerBlock(cfg, 0, 0, device, False, dtype, state.groups()).to(dtype)
    x0 = torch.randn(seq, micro, cfg.hidden_size, device=device, dtype=dtype)
    g_block = torch.randn_like(x0)

    def layer(docs: bool):
        spans = DocSpans.from_ids(ids, EOD) if docs else None
        x = x0.clone().requires_grad_()
        block(x, cos, sin, spans).backward(g_block)

    row = dict(seq=seq, micro=micro, doc_len=doc_len, documents=int((ids == EOD).sum()) + micro)
    row["attn_causal_ms"] = timed(lambda: op(False), reps, device)
    row["attn_documents_ms"] = timed(lambda: op(True), reps, device)
    row["kernel"] = ("cudnn" if attn._CUDNN_BIAS["ok"] else "efficient") if device.type == "cuda" else "cpu flash"
    row["block_causal_ms"] = timed(lambda: layer(False), reps, device)
    row["block_documents_ms"] = timed(lambda: layer(True), reps, device)
    row["overhead_pct"] = 100.0 * (row["block_documents_ms"] / row["block_causal_ms"] - 1.0)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", default="4096,8192")
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--doc-len", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="tiny shapes on the CPU (smoke test)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29543", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        os.environ.setdefault(k, v)
    small = a.small or not torch.cuda.is_available()
    device = torch.device("cpu" if small else "cuda")
    state.init(1, 1, False, "gloo" if small else "nccl")
    if small:
        cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128)
        seqs, dtype, reps = [64], torch.float32, 1
    else:
        cfg = ModelConfig(
            num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336,
            seq_length=max(int(s) for s in a.seq.split(",")), rope_theta=500000.0,
        )  # fmt: skip
        seqs, dtype, reps = [int(s) for s in a.seq.split(",")], torch.bfloat16, a.reps
    rows = [measure(cfg, s, a.micro, min(a.doc_len, s), device, dtype, reps) for s in seqs]
    dev = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    result = {"device": dev, "torch": torch.__version__, "cases": rows}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"{'seq':>6} {'docs':>5} {'attn causal':>12} {'attn docs':>10} {'block causal':>13} {'block docs':>11} "
          f"{'overhead':>9}  kernel ({dev})")  # fmt: skip
    for r in rows:
        print(f"{r['seq']:>6} {r['documents']:>5} {r['attn_causal_ms']:>10.2f}ms {r['attn_documents_ms']:>8.2f}ms "
              f"{r['block_causal_ms']:>11.2f}ms {r['block_documents_ms']:>9.2f}ms {r['overhead_pct']:>8.1f}%  "
              f"{r['kernel']}")  # fmt: skip
    state.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
