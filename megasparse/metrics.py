"""Throughput accounting and the per-step metrics log (console line + metrics.jsonl)."""

from __future__ import annotations

import json
import math
import os
import resource
import sys
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


def device_mem_gib(device: torch.device) -> float | None:
    """The memory ``peak_mem_gib`` is a share of: the GPU's, or the host's physical memory on CPU (None: unknown)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**30
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def strict_json(v):
    """``v`` with NaN/inf floats as None, so every line of metrics.jsonl is valid JSON."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: strict_json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [strict_json(x) for x in v]
    return v


def truncate_after(path: Path, step: int) -> int:
    """Keep the records of steps <= ``step`` (a resume replays the later ones); returns how many were dropped."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # a line cut by a kill mid-write
            dropped += 1
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
            kept.append(line)
        else:
            dropped += 1
    path.write_text("".join(x + "\n" for x in kept))
    return dropped


class MetricsLog:
    """Writes one JSON object per step to <out_dir>/metrics.jsonl (rank 0 only), and to TensorBoard / W&B
    when asked. ``resume_step``: continue the file after dropping records past the resumed step."""

    def __init__(
        self,
        out_dir: str,
        enabled: bool,
        resume_step: int | None = None,
        tensorboard: bool = False,
        wandb_project: str | None = None,
        config: dict | None = None,
    ):
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.jsonl"
        self.tb = self.wandb = None
        if not enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        if resume_step is not None:
            truncate_after(self.path, resume_step)
        self.f = open(self.path, "a" if resume_step is not None else "w")  # noqa: SIM115
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                print(
                    "logging.tensorboard=true but the tensorboard package is missing (pip install tensorboard); "
                    "metrics go to metrics.jsonl only",
                    file=sys.stderr,
                    flush=True,
                )
            else:
                self.tb = SummaryWriter(log_dir=str(Path(out_dir) / "tensorboard"))
        if wandb_project:
            try:
                import wandb
            except ImportError:
                print(
                    f"logging.wandb_project={wandb_project} but the wandb package is missing (pip install wandb); "
                    "metrics go to metrics.jsonl only",
                    file=sys.stderr,
                    flush=True,
                )
            else:
                self.wandb = wandb.init(project=wandb_project, dir=out_dir, config=config, resume="allow")

    def write(self, rec: dict) -> None:
        if not self.enabled:
            return
        clean = strict_json(rec)
        self.f.write(json.dumps(clean, allow_nan=False) + "\n")
        self.f.flush()
        scalars = {k: v for k, v in clean.items() if isinstance(v, (int, float)) and k != "step"}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, rec["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=rec["step"])

    def close(self) -> None:
        if self.enabled:
            self.f.close()
            if self.tb is not None:
                self.tb.close()
            if self.wandb is not None:
                self.wandb.finish()


def short_count(n: float) -> str:
    """1234567 -> 1.23M: token counts on the console."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{suffix}"
    return f"{n:.0f}"


def _hms(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def format_line(rec: dict) -> str:
    """The console line of one step: where the run is (step N/T, ms per step, ETA, tokens seen), what the step did
    (loss, gradient norm, lr, kept share when filtering, 2:4 phase) and what it cost (throughput, memory)."""
    total = rec.get("steps_total")
    parts = [f"step {rec['step']}/{total}" if total else f"step {rec['step']:>5d}"]
    parts += [f"loss {rec['loss']:.4f}", f"gnorm {rec['grad_norm']:.3f}", f"lr {rec['lr']:.2e}"]
    if rec.get("step_ms") is not None:
        parts.append(f"{rec['step_ms']:,.0f} ms/step")
    if rec.get("eta_s") is not None:
        parts.append(f"ETA {_hms(rec['eta_s'])}")
    if rec.get("tokens_seen") is not None:
        parts.append(f"{short_count(rec['tokens_seen'])} tokens")
    if rec.get("real_tokens") is not None:  # chunkflow: the step's real (non-padding) predictions
        parts.append(f"{short_count(rec['real_tokens'])} real/step, fill {100 * rec['chunk_fill']:.0f}%")
        if rec.get("real_kept_share") is not None:
            parts.append(f"kept {100 * rec['real_kept_share']:.0f}% of real")
    if rec.get("kept_share") is not None and rec.get("real_kept_share") is None:  # (chunkflow: of its real tokens)
        parts.append(f"kept {100 * rec['kept_share']:.0f}%")
    if rec.get("sparse") is not None:
        parts.append("2:4 sparse" if rec["sparse"] else "2:4 dense")
    parts += [f"tok/s/gpu {rec['tokens_per_s']:,.0f}", f"TFLOP/s/gpu {rec['tflops_per_gpu']:.1f}"]
    if rec.get("mfu") is not None:
        parts.append(f"MFU {100 * rec['mfu']:.1f}%")
    share = rec.get("mem_share")
    parts.append(f"mem {rec['mem_gib']:.2f} GiB" + (f" ({100 * share:.0f}%)" if share is not None else ""))
    if rec.get("flip_rate"):
        parts.append(f"flip {rec['flip_rate'].get('all', 0.0):.4f}")
    if rec.get("val_loss") is not None:
        parts.append(f"val {rec['val_loss']:.4f}")
    return " | ".join(parts)


class Progress:
    """Per-step progress fields for the log line and metrics.jsonl: ms per step and the ETA from the median of the
    last ``window`` steps (the first steps also capture CUDA graphs, time the loss and autotune 2:4 GEMMs, so a mean
    would overstate the rest of the run)."""

    def __init__(self, total_steps: int, window: int = 20):
        self.total, self.window = total_steps, window
        self.times: list[float] = []

    def fields(
        self, step: int, seconds: float, tokens_seen: int, kept_share: float | None = None
    ) -> dict[str, float | int | None]:
        """``step`` (1-based, done), its wall time, global tokens consumed so far, kept share of a filtered step."""
        self.times = (self.times + [seconds])[-self.window :]
        median = sorted(self.times)[(len(self.times) - 1) // 2]  # the lower one: a slow first step is not typical
        return {
            "steps_total": self.total,
            "step_ms": 1e3 * seconds,
            "eta_s": max(0, self.total - step) * median,
            "tokens_seen": tokens_seen,
            "kept_share": kept_share,
        }


def step_record(
    step: int, loss: float, grad_norm: float, lr: float, tokens_per_s: float, flops_tok: float, peak, device
) -> dict:
    """The per-step metrics line (metrics.jsonl and the console): throughput per GPU, TFLOP/s, MFU, peak memory."""
    tflops = tokens_per_s * flops_tok / 1e12
    mem, total = peak_mem_gib(device), device_mem_gib(device)
    return {
        "step": step,
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": lr,
        "tokens_per_s": tokens_per_s,
        "tflops_per_gpu": tflops,
        "mfu": tflops / peak if peak else None,
        "mem_gib": mem,
        "mem_share": mem / total if total else None,
    }
