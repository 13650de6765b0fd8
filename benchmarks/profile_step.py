"""Where a step's time goes, per mode: wall time, GPU kernel time, kernel launches and the host's hot spots.

    torchrun --nproc_per_node N benchmarks/profile_step.py LAYOUT [--modes dense,collider] [--micro 1]
        [--steps 4] [--out-dir docs/benchmarks/data] [section.key=value ...]

Why: a filtered step that does less GPU work and still takes longer is host-bound, and only a profile says so. With
``train.cuda_graphs=false`` this shows what an eager step pays (what stays eager: ``cudagraph.capture_blocker``).
Each mode's trainer warms up, times ``--steps`` steps (median, slowest rank), then runs one step under
``torch.profiler`` (CPU and CUDA) and reports the kernel time, the launch calls and the ops with the most own
host time. Same layouts and modes as ``bench_e2e.py``. Writes ``profile_<layout>.json`` (``device``, ``cases``:
mode, micro_batch_size, step_ms, gpu_kernel_ms (kernels only, no copies or fills), launches (host launch calls; a
graph replay is one), host_self_cpu_ms, top_host_ops, top_kernels, and on CUDA ``timeline``: the profiled step's
GPU time split into compute, communication with no compute beside it, and idle, with the longest compute gaps) and
prints the table last (``--tables N``: the profiler's own tables too).
Profiled host times run 1.3–2× slower than unprofiled ones: compare them between modes, not with ``step_ms``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_e2e as be  # noqa: E402
import bench_trainer as bt  # noqa: E402

from megasparse.config import load_config  # noqa: E402
from megasparse.configbase import parse_with_overrides  # noqa: E402
from megasparse.parallel import state  # noqa: E402
from megasparse.train import Trainer  # noqa: E402

_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch")
"""Launch calls on the host; a replayed CUDA graph is one (``train.cuda_graphs``, on by default)."""
_TIMELINE = ("compute_busy_ms", "exposed_comm_ms", "idle_ms")


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _minus(spans: list[tuple[float, float]], cut: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of the (merged) ``spans`` that no span of the (merged) ``cut`` covers."""
    out, j = [], 0
    for a, b in spans:
        while j < len(cut) and cut[j][1] <= a:
            j += 1
        k, start = j, a
        while k < len(cut) and cut[k][0] < b:
            if cut[k][0] > start:
                out.append((start, cut[k][0]))
            start = max(start, cut[k][1])
            k += 1
        if start < b:
            out.append((start, b))
    return out


def timeline(trace: dict, gaps: int = 5) -> dict:
    """Where a step's wall time goes on the GPU, from a chrome trace of it: the span from its first kernel to its
    last, the time some compute kernel runs (any stream, overlaps merged), the communication that runs with no
    compute beside it (``exposed_comm_ms``: NCCL kernels, waiting included), the time the GPU runs nothing, and the
    longest idle gaps of the compute streams with the kernels around them. Why: two modes with the same kernel time
    can differ in step time only here (an eager step that waits on its host, or on a collective)."""
    kernels = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and e.get("dur", 0) > 0]
    if not kernels:
        return {}
    nccl = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if e["name"].startswith("nccl")]
    comp = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in kernels if not e["name"].startswith("nccl"))
    busy, comm = _union([(a, b) for a, b, _ in comp]), _union(nccl)
    t0, t1 = min(e["ts"] for e in kernels), max(e["ts"] + e["dur"] for e in kernels)
    holes, end = [], None
    for a, b, name in comp:
        if end is not None and a > end[0]:
            holes.append((a - end[0], end[1], name))
        if end is None or b > end[0]:
            end = (b, name)
    holes.sort(reverse=True)
    return {
        "span_ms": (t1 - t0) / 1e3,
        "compute_busy_ms": _length(busy) / 1e3,
        "exposed_comm_ms": _length(_minus(comm, busy)) / 1e3,
        "idle_ms": (t1 - t0 - _length(_union([(a, b) for a, b, _ in comp] + nccl))) / 1e3,
        "compute_gaps": [{"ms": d / 1e3, "after": x[:60], "before": y[:60]} for d, x, y in holes[:gaps]],
    }


def profile_case(cfg, warmup: int, steps: int, top: int = 40, tables: int = 0) -> dict:
    """Warm up, time ``steps`` steps, profile one more: the case's numbers on this rank (``tables``: also print the
    profiler's tables by GPU and by own host time, that many rows, on rank 0)."""
    tr = Trainer(cfg, init_groups=False)
    for _ in range(bt.warmup_steps(cfg, warmup)):
        tr.train_step()
    times = []
    for _ in range(steps):
        bt._sync(tr.device)
        times.append(tr.train_step().seconds)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if tr.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        bt._sync(tr.device)
        tr.train_step()
        bt._sync(tr.device)
    span = {}
    if tr.device.type == "cuda":
        with tempfile.TemporaryDirectory() as tmp:
            prof.export_chrome_trace(f"{tmp}/trace.json")
            span = timeline(json.loads(Path(f"{tmp}/trace.json").read_text()))
    ka = prof.key_averages()
    cuda = torch.autograd.DeviceType.CUDA
    kernels = [e for e in ka if e.device_type == cuda and not e.key.startswith(("Memcpy", "Memset"))]
    kernel_us = sum(e.self_device_time_total for e in kernels)
    ops = sorted((e for e in ka if e.key not in _LAUNCHES), key=lambda e: e.self_cpu_time_total, reverse=True)
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    if tables and state.world_env()[0] == 0:
        for key in ("self_cuda_time_total", "self_cpu_time_total") if kernels else ("self_cpu_time_total",):
            print(ka.table(sort_by=key, row_limit=tables, max_name_column_width=60), flush=True)
    if getattr(tr, "graphs", None) is not None:
        tr.graphs.release()
    del tr
    bt._free()
    return {
        "step_ms": 1e3 * statistics.median(times),
        "gpu_kernel_ms": kernel_us / 1e3,
        "launches": sum(e.count for e in ka if e.key in _LAUNCHES),
        "host_self_cpu_ms": sum(e.self_cpu_time_total for e in ka) / 1e3,
        "top_host_ops": [
            {"name": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3, "calls": e.count} for e in ops[:top]
        ],
        "timeline": span,
        "top_kernels": [
            {"name": e.key, "gpu_ms": e.self_device_time_total / 1e3, "calls": e.count} for e in kernels[:top]
        ],
    }


def format_table(report: dict) -> str:
    head = (
        f"{'mode':<16} {'mb':>3} {'step ms':>9} {'GPU ms':>8} {'busy ms':>8} {'comm ms':>8} {'idle ms':>8} "
        f"{'launches':>9} {'host ms*':>9}  top host op (own ms)"
    )
    lines = [f"profile | {report['device']} | {report['layout']}: {report['shape']}", head, "-" * len(head)]
    for c in report["cases"]:
        if "error" in c:
            lines.append(f"{c['mode']:<16} {c['micro_batch_size']:>3}  {c['error'][:60]}")
            continue
        op = c["top_host_ops"][0] if c["top_host_ops"] else {"name": "-", "self_cpu_ms": 0.0}
        tl = c.get("timeline") or {}
        busy, comm, idle = (f"{tl[k]:8.1f}" if k in tl else f"{'-':>8}" for k in _TIMELINE)
        lines.append(
            f"{c['mode']:<16} {c['micro_batch_size']:>3} {c['step_ms']:9.1f} {c['gpu_kernel_ms']:8.1f} {busy} {comm} "
            f"{idle} {c['launches']:9d} {c['host_self_cpu_ms']:9.1f}  {op['name'][:40]} ({op['self_cpu_ms']:.1f})"
        )
    lines.append(
        "busy: some compute kernel runs; comm: NCCL runs with no compute beside it (waits included); idle: the GPU "
        "runs nothing (CUDA, profiled step)"
    )
    lines.append("*host ms: own CPU time of every op in the profiled step (profiling slows the host 1.3-2x)")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("layout", choices=list(be.LAYOUTS))
    p.add_argument("overrides", nargs="*", help="extra dotted config overrides for every case")
    p.add_argument("--modes", default="dense,collider")
    p.add_argument("--micro", default="1")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--tables", type=int, default=0, help="also print the profiler's tables, this many rows")
    p.add_argument("--gpu-warmup-s", type=float, default=10.0, help="GEMMs before the first case, to settle clocks")
    p.add_argument("--tag", default="", help="suffix of the JSON's name: profile_<layout>_<tag>.json")
    p.add_argument("--out-dir", default=os.environ.get("OUT", str(be.ROOT / "docs" / "benchmarks" / "data")))
    return parse_with_overrides(p, argv)  # key=value anywhere on the line


def main(argv: list[str] | None = None) -> int:
    a = parse_args(list(sys.argv[1:] if argv is None else argv))
    modes = [m for m in a.modes.split(",") if m]
    opened = be.open_layout("profile_step", a.layout, a.overrides, modes)
    if opened is None:
        return 2
    cfg_path, base_ov, base, world, dev, device = opened
    p, m = base.parallel, base.model
    report: dict = {
        "device": device,
        "layout": a.layout,
        "shape": f"{m.num_layers} layers, hidden {m.hidden_size}, seq {m.seq_length}, tp {p.tp} pp {p.pp}, "
        f"global batch {base.train.global_batch_size}, cuda_graphs {base.train.cuda_graphs}",
        "overrides": base_ov,
        "torch": torch.__version__,
        "cases": [],
    }
    if dev.type == "cuda" and a.gpu_warmup_s > 0:
        be.warm_gpu(a.gpu_warmup_s, dev)
    for mb in [int(x) for x in a.micro.split(",")]:
        for mode in modes:
            cfg = load_config(
                str(be.ROOT / cfg_path), base_ov + [f"train.micro_batch_size={mb}"] + be.mode_overrides(mode)
            )
            bt.log0(f"--- {mode} micro_batch_size={mb} ---")
            try:
                r = profile_case(cfg, a.warmup, a.steps, tables=a.tables)
            except torch.OutOfMemoryError as e:  # the other cases still count
                bt._free()
                bt.log0(f"{mode} mb={mb}: {type(e).__name__}")
                err = f"{type(e).__name__}: {e}"[:300]
                report["cases"].append({"mode": mode, "micro_batch_size": mb, "error": err})
                continue
            r["step_ms"] = max(x[0] for x in bt.gather_floats([r["step_ms"]], dev))  # the slowest rank's
            report["cases"].append({"mode": mode, "micro_batch_size": mb, **r})
    report["table"] = format_table(report)
    if state.world_env()[0] == 0:
        out = Path(a.out_dir) / f"profile_{a.layout}{'_' + a.tag if a.tag else ''}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        print(report["table"], flush=True)
    state.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
