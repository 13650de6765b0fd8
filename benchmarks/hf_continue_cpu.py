"""Continued pre-training from a Hugging Face directory on CPU, end to end and timed: a TinyLlama-shaped but
2-layer Llama (random weights, bf16 safetensors written by transformers, no download) is imported, trained a few
steps with token filtering (Collider backward, loss scorer: no reference needed), exported and evaluated.

    python benchmarks/hf_continue_cpu.py --workdir /tmp/hf_cpu [--steps 3] [--nproc 1]

Prints one line per phase with its wall time, and the total.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path


def make_hf(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4,
        num_hidden_layers=2, vocab_size=32000, max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--workdir", default="/tmp/hf_cpu")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--nproc", type=int, default=1)
    a = p.parse_args()
    w = Path(a.workdir) / time.strftime("%Y%m%d-%H%M%S")  # a new directory per run: nothing earlier is written over
    w.mkdir(parents=True)
    ms = [sys.executable, "-m", "megasparse"]
    run = (
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(a.nproc), "-m", "megasparse"]
        if a.nproc > 1
        else ms
    )
    common = ["data.tokenizer=builtin:shakespeare", "model.seq_length=128", "train.device=cpu", "train.dtype=fp32"]
    phases = [
        ("hf import", ms + ["hf", "import", str(w / "hf"), str(w / "imported")]),
        (
            "train (filtered)",
            run
            + [
                "train",
                str(w / "imported/config.yaml"),
                "data.prefix=builtin:shakespeare",
                *common,
                f"train.steps={a.steps}",
                "train.micro_batch_size=1",
                f"train.global_batch_size={a.nproc}",
                "train.eval_interval=0",
                "filter.mode=collider",
                "filter.scorer=loss",
                "filter.keep_ratio=0.6",
                "optim.warmup_steps=1",
                f"logging.out_dir={w / 'run'}",
            ],
        ),  # fmt: skip
        ("hf export", ms + ["hf", "export", str(w / "run"), str(w / "exported"), "--dtype", "bf16"]),
        (
            "eval",
            run
            + [
                "eval",
                str(w / "run"),
                "--data",
                "builtin:shakespeare",
                *common,
                "train.micro_batch_size=1",
                f"train.global_batch_size={a.nproc}",
                "data.valid_fraction=0.002",
            ],
        ),  # fmt: skip
    ]
    t_all = time.perf_counter()
    t = time.perf_counter()
    if not (w / "hf/config.json").exists():
        make_hf(w / "hf")
    print(f"write HF dir: {time.perf_counter() - t:.1f} s (not counted)", flush=True)
    t_all = time.perf_counter()
    for name, cmd in phases:
        t = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True)
        tail = (r.stdout + r.stderr).strip().splitlines()[-3:]
        print(f"{name}: {time.perf_counter() - t:.1f} s, rc {r.returncode}: " + " | ".join(tail), flush=True)
        if r.returncode:
            return r.returncode
    print(f"total (import, train, export, eval): {time.perf_counter() - t_all:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
