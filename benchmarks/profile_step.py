"""Where a step's time goes: torch.profiler tables (CUDA and CPU time) of one dense and one collider step.

python benchmarks/profile_step.py --layers 8 --seq 4096 --mb 1 [--rows 15]
torchrun --nproc_per_node 2 benchmarks/profile_step.py --tp 2 [--sp] --mb 4 [--granularity batch]   (rank 0 prints)
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from megasparse.config import load_config
from megasparse.parallel import state
from megasparse.train import Trainer


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mb", type=int, default=1)
    p.add_argument("--rows", type=int, default=15)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--sp", action="store_true")
    p.add_argument("--granularity", default="sequence")
    a = p.parse_args()
    state.init(a.tp, 1, a.sp)
    rank0 = state.layout().tp_rank == 0
    for mode in ("off", "collider"):
        cfg = load_config(None, [
            "data.prefix=synthetic", "model.vocab_size=32000", f"model.seq_length={a.seq}", "model.hidden_size=2048",
            "model.num_attention_heads=32", "model.num_query_groups=4", "model.ffn_hidden_size=5632",
            f"model.num_layers={a.layers}", f"train.micro_batch_size={a.mb}", f"train.global_batch_size={a.mb}",
            "train.eval_interval=0", f"filter.mode={mode}", "filter.keep_ratio=0.6", "filter.scorer=loss",
            f"filter.granularity={a.granularity}", f"parallel.tp={a.tp}", f"parallel.sequence_parallel={a.sp}",
        ])  # fmt: skip
        tr = Trainer(cfg, init_groups=False)
        for _ in range(3):
            tr.train_step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            r = tr.train_step()
            torch.cuda.synchronize()
        if rank0:
            print(f"\n== {mode}: step {r.seconds * 1e3:.1f} ms (wall, profiled) ==")
            ka = prof.key_averages()
            print(ka.table(sort_by="self_cuda_time_total", row_limit=a.rows, max_name_column_width=70))
            print(ka.table(sort_by="cpu_time_total", row_limit=a.rows, max_name_column_width=70))
            cuda_total = sum(e.self_device_time_total for e in ka) / 1e3
            print(f"{mode}: total self CUDA time {cuda_total:.1f} ms vs wall {r.seconds * 1e3:.1f} ms")
        del tr
    state.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
