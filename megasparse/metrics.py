"""Throughput accounting and the per-step metrics log (console line + metrics.jsonl)."""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path

import torch

from megasparse.model.config import ModelConfig

# Dense bf16 tensor-core peaks (TFLOP/s) used for MFU, by device-name substring.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def param_counts(cfg: ModelConfig, vocab: int) -> tuple[int, int]:
    """(non-embedding parameters incl. the output layer, input-embedding parameters) of the full model."""
    h, f, d = cfg.hidden_size, cfg.ffn_size, cfg.head_dim
    attn = h * (cfg.num_attention_heads + 2 * cfg.kv_heads) * d + cfg.num_attention_heads * d * h
    mlp = 3 * h * f
    per_layer = attn + mlp + 2 * h
    return cfg.num_layers * per_layer + h + vocab * h, vocab * h


def flops_per_token(cfg: ModelConfig, vocab: int) -> float:
    """Training FLOPs per token: 6·N (matmul params incl. output layer) + 12·L·h·s attention (PaLM, App. B)."""
    n, _ = param_counts(cfg, vocab)
    return 6.0 * n + 12.0 * cfg.num_layers * cfg.hidden_size * cfg.seq_length


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, val in PEAK_TFLOPS.items():
        if key in name:
            return val
    return None


def peak_mem_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class MetricsLog:
    """Writes one JSON object per step to <out_dir>/metrics.jsonl (rank 0 only)."""

    def __init__(self, out_dir: str, enabled: bool, resume: bool = False):
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.jsonl"
        if enabled:
            os.makedirs(out_dir, exist_ok=True)
            self.f = open(self.path, "a" if resume else "w")  # noqa: SIM115

    def write(self, rec: dict) -> None:
        if self.enabled:
            self.f.write(json.dumps(rec) + "\n")
            self.f.flush()

    def close(self) -> None:
        if self.enabled:
            self.f.close()


def format_line(rec: dict) -> str:
    parts = [
        f"step {rec['step']:>5d}",
        f"loss {rec['loss']:.4f}",
        f"gnorm {rec['grad_norm']:.3f}",
        f"lr {rec['lr']:.2e}",
        f"tok/s/gpu {rec['tokens_per_s']:,.0f}",
        f"TFLOP/s/gpu {rec['tflops_per_gpu']:.1f}",
    ]
    if rec.get("mfu") is not None:
        parts.append(f"MFU {100 * rec['mfu']:.1f}%")
    parts.append(f"mem {rec['mem_gib']:.2f} GiB")
    if rec.get("flip_rate"):
        parts.append(f"flip {rec['flip_rate'].get('all', 0.0):.4f}")
    if rec.get("val_loss") is not None:
        parts.append(f"val {rec['val_loss']:.4f}")
    return " | ".join(parts)
