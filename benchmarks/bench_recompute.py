"""Activation memory and time of Llama-3-8B-shaped layers under each ``model.recompute`` mode, one GPU.

    python benchmarks/bench_recompute.py [--layers 4] [--seq 8192] [--micro 1] [--out runs/bench_recompute.json]

For none / selective / full: the layers' forward then backward (bf16, random weights, no loss), reporting what the
forward leaves saved for the backward (``saved_gib``: allocated after the forward less before it), the peak during
forward + backward above the start (``peak_gib``) and the median fwd+bwd time over a few repetitions. Decision 0012
explains the modes; the whole-trainer view is ``bench_e2e.py 1gpu_8b4l --modes dense,dense/recompute-selective,
dense/recompute-full``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megasparse.model.config import ModelConfig  # noqa: E402
from megasparse.model.gpt import TransformerBlock  # noqa: E402
from megasparse.ops.attention import rope_tables  # noqa: E402
from megasparse.parallel import state  # noqa: E402

GIB = 2**30


def measure(mode: str, layers: int, seq: int, micro: int, reps: int = 5) -> dict:
    cfg = ModelConfig(
        num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336,
        seq_length=seq, rope_theta=500000.0, recompute=mode,
    )  # fmt: skip
    # bf16 parameters: the per-use cast is then the parameter itself, so ``saved`` counts activations only (the
    # trainer's compute copies exist once per step, not per use)
    pg = state.groups()
    blocks = [TransformerBlock(cfg, i, 0, "cuda", False, torch.bfloat16, pg).to(torch.bfloat16) for i in range(layers)]
    cos, sin = rope_tables(seq, cfg.head_dim, cfg.rope_theta, "cuda")
    x0 = torch.randn(seq, micro, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(x0)
    times, saved, peak = [], 0, 0
    for _ in range(reps + 1):
        for b in blocks:
            b.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start_mem = torch.cuda.memory_allocated()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        y = x
        for b in blocks:
            y = b(y, cos, sin)
        torch.cuda.synchronize()
        saved = torch.cuda.memory_allocated() - start_mem - y.numel() * y.element_size()
        y.backward(g)
        t1.record()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - start_mem
        times.append(t0.elapsed_time(t1))
    del blocks
    torch.cuda.empty_cache()
    return dict(mode=mode, layers=layers, seq=seq, micro=micro, saved_gib=saved / GIB, peak_gib=peak / GIB,
                fwd_bwd_ms=statistics.median(times[1:]))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29541", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        os.environ.setdefault(k, v)
    state.init(1, 1, False, "nccl")
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    rows = [measure(m, a.layers, a.seq, a.micro) for m in ("none", "selective", "full")]
    for r in rows:
        print(f"{r['mode']:>9}: saved {r['saved_gib']:.2f} GiB  peak {r['peak_gib']:.2f} GiB  "
              f"fwd+bwd {r['fwd_bwd_ms']:.1f} ms  ({r['saved_gib'] / rows[0]['saved_gib']:.2f}x saved, "
              f"{r['fwd_bwd_ms'] / rows[0]['fwd_bwd_ms']:.2f}x time)")  # fmt: skip
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    state.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
