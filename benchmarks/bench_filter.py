"""Token-filtering speed: dense vs loss_mask (Rho-1) vs collider (dimension-reduced backward), same run.

    python benchmarks/bench_filter.py --layers 8 --seq 4096 --keep 0.6 [--sweep] [--json out.json]
    torchrun --nproc_per_node 2 benchmarks/bench_filter.py --tp 2 ...

TinyLlama-1.1B layer shapes (hidden 2048, 32 heads, 4 KV heads, FFN 5632), bf16, synthetic tokens, micro-batch 1.
Times (CUDA-synchronised, median of --iters): forward (incl. loss), selection + compaction, backward,
optimizer+reductions, whole step. Prints a table last and writes JSON naming the device.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from megasparse.config import load_config
from megasparse.ops.compact import KeepHolder
from megasparse.parallel import comm, state
from megasparse.train import Trainer


def overrides(a, mode: str, keep: float, seq: int) -> list[str]:
    return [
        "data.prefix=synthetic",
        "model.vocab_size=32000",
        f"model.seq_length={seq}",
        "model.hidden_size=2048",
        "model.num_attention_heads=32",
        "model.num_query_groups=4",
        "model.ffn_hidden_size=5632",
        f"model.num_layers={a.layers}",
        f"parallel.tp={a.tp}",
        f"parallel.sequence_parallel={str(a.sp).lower()}",
        f"train.micro_batch_size={a.mb}",
        f"train.global_batch_size={a.mb * a.dp}",
        "train.eval_interval=0",
        f"filter.mode={mode}",
        f"filter.keep_ratio={keep}",
        "filter.scorer=loss",
        f"filter.granularity={a.granularity or ('shard' if a.sp else 'sequence')}",
        "checkpoint.save_at_end=false",
    ]


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_step(tr: Trainer, iters: int, warmup: int) -> dict:
    """One micro-batch per step on a single pipeline stage, phases timed separately."""
    phases: dict[str, list[float]] = {k: [] for k in ("forward", "select", "backward", "optim", "step")}
    mode = tr.cfg.filter.mode
    for it in range(warmup + iters):
        batch = tr._microbatches(tr.train_ds, tr.consumed, 1)[0]
        ids, targets = batch.ids, batch.targets
        tr.dp_opt.zero_grad()
        sync()
        t0 = time.perf_counter()
        keep = KeepHolder()
        out = tr.model(ids, targets, keep)
        sync()
        t1 = time.perf_counter()
        if mode == "off":
            loss = out.mean()
        else:
            loss = tr.filter.masked_loss(out, batch, keep, tr.step, 0) / tr.filter.kept_rows
        sync()
        t2 = time.perf_counter()
        with comm.phase("backward"):
            loss.backward()
        sync()
        t3 = time.perf_counter()
        tr.dp_opt.reduce()
        tr.dp_opt.grad_norm()
        tr.dp_opt.step()
        sync()
        t4 = time.perf_counter()
        tr.consumed += tr.cfg.train.global_batch_size
        if it >= warmup:
            for k, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
                phases[k].append(dt * 1e3)
    out = {k: statistics.median(v) for k, v in phases.items()}
    # One more step with every transfer recorded (and, on GPU, timed in isolation): backward traffic and time.
    rec = comm.CommRecorder(time_on_gpu=torch.cuda.is_available())
    with comm.recording(rec):
        time_step_once(tr)
    bwd = [r for r in rec.records if r.phase == "backward"]
    out["bwd_comm_mb"] = sum(r.bytes for r in bwd) / 2**20
    out["bwd_comm_ms"] = sum(r.duration_ms or 0.0 for r in bwd)
    return out


def time_step_once(tr: Trainer) -> None:
    tr.cfg.train.eval_interval = 0
    tr.train_step()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--keep", type=float, default=0.6)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--mb", type=int, default=1, help="sequences per micro-batch (one micro-batch per step)")
    p.add_argument("--sp", action="store_true")
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--granularity", default=None, help="filter.granularity (default: shard with --sp, else sequence)")
    p.add_argument("--sweep", action="store_true", help="also sweep keep 0.9..0.3 and seq 1K..8K (collider vs dense)")
    p.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "bench_filter.json"))
    a = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    a.dp = world // a.tp
    state.init(a.tp, 1, a.sp)
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    rows = []

    def run(mode: str, keep: float, seq: int) -> dict:
        cfg = load_config(None, overrides(a, mode, keep, seq))
        if not torch.cuda.is_available():
            cfg.train.device, cfg.train.dtype = "cpu", "fp32"
        tr = Trainer(cfg, init_groups=False)
        r = time_step(tr, a.iters, a.warmup)
        r.update(
            mode=mode,
            keep=keep,
            seq=seq,
            mem_gib=torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
        )
        del tr
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        return r

    main_rows = [run(m, a.keep, a.seq) for m in ("off", "loss_mask", "collider")]
    rows += main_rows
    sweep = []
    if a.sweep:
        for seq in (1024, 2048, 4096, 8192):
            dense = run("off", 1.0, seq) if seq != a.seq else main_rows[0]
            for keep in (0.9, 0.75, 0.6, 0.45, 0.3):
                c = run("collider", keep, seq)
                sweep.append(
                    {
                        "seq": seq,
                        "keep": keep,
                        "step_speedup": dense["step"] / c["step"],
                        "bwd_ratio": c["backward"] / dense["backward"],
                    }
                )
    if rank0:
        out = {
            "device": dev,
            "world": world,
            "tp": a.tp,
            "sp": a.sp,
            "layers": a.layers,
            "rows": rows,
            "sweep": sweep,
            "torch": torch.__version__,
        }
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
        d = main_rows[0]
        if sweep:
            print("\nsweep (collider vs dense): seq keep step-speedup bwd-ratio")
            for s in sweep:
                print(f"  {s['seq']:5d} {s['keep']:.2f} {s['step_speedup']:.3f} {s['bwd_ratio']:.3f}")
        print(
            f"\n{dev}, world {world}, tp {a.tp}{' +SP' if a.sp else ''}, {a.layers} TinyLlama layers, seq {a.seq}, "
            f"micro-batch {a.mb}, keep {a.keep}, granularity {a.granularity or ('shard' if a.sp else 'sequence')}"
        )
        print(
            "| mode | fwd ms | select ms | bwd ms | optim ms | step ms | bwd vs dense | step vs dense | sel % step "
            "| bwd comm MB | bwd comm ms (isolated) |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in main_rows:
            print(
                f"| {r['mode']} | {r['forward']:.1f} | {r['select']:.2f} | {r['backward']:.1f} | {r['optim']:.1f} | "
                f"{r['step']:.1f} | {r['backward'] / d['backward']:.3f} | {r['step'] / d['step']:.3f} | "
                f"{100 * r['select'] / r['step']:.2f} | {r['bwd_comm_mb']:.1f} | {r['bwd_comm_ms']:.2f} |"
            )
    state.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
