"""2:4 FST accuracy check on CPU: a small GPT on the bundled corpus, dense against the sparse recipe and two
ablations at equal steps. Anchor: the dense run of the same invocation; the gap is (sparse − dense) / dense
of the final validation loss (target for the full recipe: ≤ 3%).

Runs (one process each, tp=1, OMP_NUM_THREADS=1, at most --jobs at once):
  dense          sparsity off
  fst            2:4 FST full recipe (masked decay λ from `sparsity decay-search`, dense fine-tuning)
  fst_no_decay   same with sparsity.decay=0
  fst_no_dense   same with sparsity.dense_finetune_fraction=0
  dense_monitor  dense training that computes masks and flip rates only (the reference flip-rate curve)
  *_seedN        dense and fst again from another initialisation (--noise-seed; 0 skips them)

    python benchmarks/sparse24_accuracy.py [--steps 150] [--decay search|FLOAT] [--reuse] [--plot-only]

Writes <out>/sparse24_accuracy.json and the two plots (validation loss, flip rate), prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FALLBACK_DECAY = 2e-4
"""The recipe's default λ (megasparse/sparse24/config.py), used when the search finds no feasible λ."""


def common_overrides(args: argparse.Namespace) -> list[str]:
    return [
        "parallel.tp=1",
        f"model.seq_length={args.seq}",
        f"train.steps={args.steps}",
        f"train.micro_batch_size={args.batch}",
        f"train.global_batch_size={args.batch}",
        f"train.eval_interval={args.eval_interval}",
        f"train.eval_batches={args.eval_batches}",
        "checkpoint.save_at_end=false",
        f"sparsity.refresh_interval={args.refresh}",
    ]


def run_plan(decay: float, noise_seed: int) -> dict[str, list[str]]:
    on = "sparsity.enabled=true"
    plan = {
        "dense": [],
        "fst": [on, f"sparsity.decay={decay}"],
        "fst_no_decay": [on, "sparsity.decay=0"],
        "fst_no_dense": [on, f"sparsity.decay={decay}", "sparsity.dense_finetune_fraction=0"],
        # dense training that only computes masks: the paper's reference flip-rate curve (should match "dense")
        "dense_monitor": [on, "sparsity.monitor_only=true", "sparsity.dense_finetune_fraction=0"],
    }
    if noise_seed:  # a second initialisation of dense and full FST: how large is a gap that is only noise?
        plan[f"dense_seed{noise_seed}"] = [f"train.seed={noise_seed}"]
        plan[f"fst_seed{noise_seed}"] = [*plan["fst"], f"train.seed={noise_seed}"]
    return plan


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def finished(run_dir: Path, steps: int) -> bool:
    recs = read_metrics(run_dir)
    return bool(recs) and recs[-1]["step"] == steps and "val_loss" in recs[-1]


def launch(cmd: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    print("$", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)  # noqa: SIM115


def run_all(jobs: list[tuple[str, list[str], Path]], parallel: int) -> dict[str, float]:
    """Run (name, cmd, log) jobs, at most ``parallel`` at once; returns wall seconds per job."""
    pending, running, wall = list(jobs), {}, {}
    while pending or running:
        while pending and len(running) < parallel:
            name, cmd, log = pending.pop(0)
            running[name] = (launch(cmd, log), time.time(), log)
        time.sleep(2)
        for name, (proc, t0, log) in list(running.items()):
            if proc.poll() is None:
                continue
            del running[name]
            wall[name] = time.time() - t0
            if proc.returncode != 0:
                raise RuntimeError(f"{name} failed (rc {proc.returncode}); see {log}")
            print(f"  {name}: done in {wall[name]:.0f} s", flush=True)
    return wall


def search_decay(args: argparse.Namespace, out: Path) -> tuple[float, dict]:
    """λ from the paper's quick test; falls back to the recipe default when no λ lands in μ ∈ [0.60, 0.95]."""
    js = out / "decay_search.json"
    if not (args.reuse and js.exists()):
        cmd = [sys.executable, "-m", "megasparse", "sparsity", "decay-search", args.config, *common_overrides(args)]
        cmd += [f"logging.out_dir={out / 'decay_search'}", "--steps", str(args.search_steps)]
        cmd += ["--decays", args.search_decays, "--json", str(js)]
        t0 = time.time()
        proc = launch(cmd, out / "decay_search.log")
        if proc.wait() not in (0, 1):  # 1: ran, but no feasible λ
            raise RuntimeError(f"decay-search failed; see {out / 'decay_search.log'}")
        print(f"  decay-search: done in {time.time() - t0:.0f} s", flush=True)
    res = json.loads(js.read_text())
    best = res.get("recommended")
    return (float(best) if best is not None else FALLBACK_DECAY), res


def curves(recs: list[dict]) -> dict[str, list]:
    val = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    flip = [(r["step"], r["flip_rate"]["all"]) for r in recs if r.get("flip_rate")]
    return {"val": val, "flip": flip, "train": [(r["step"], r["loss"]) for r in recs]}


def plot(results: dict, out_val: Path, out_flip: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"dense": "k-", "fst": "C0-", "fst_no_decay": "C1--", "fst_no_dense": "C2-.", "dense_monitor": "k:"}
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, c in results["curves"].items():
        if name == "dense_monitor" or "_seed" in name:  # repeats and the monitor run are in the table only
            continue
        xs, ys = zip(*c["val"], strict=True)
        ax.plot(xs, ys, styles.get(name, "-"), marker="o", ms=3, label=f"{name} ({ys[-1]:.3f})")
    switch = results["switch_step"]
    ax.axvline(switch, color="gray", lw=0.8, ls=":", label=f"dense fine-tune from step {switch}")
    ax.set(xlabel="optimizer step", ylabel="validation loss", title=title)
    lo = min(min(y for _, y in c["val"]) for c in results["curves"].values())
    ax.set_ylim(lo - 0.1, lo + 1.6)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_val, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, c in results["curves"].items():
        if c["flip"] and "_seed" not in name:
            xs, ys = zip(*c["flip"], strict=True)
            wide = {"lw": 4, "alpha": 0.45} if name == "fst" else {}  # fst_no_dense runs on top of it to the switch
            ax.plot(xs, ys, styles.get(name, "-"), marker="o", ms=3, label=name, **wide)
    ax.set(xlabel="optimizer step", ylabel=f"flip rate per refresh ({results['refresh']} steps)", title=title)
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(out_flip, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/cpu_toy.yaml")
    p.add_argument("--out", default="runs/sparse24_accuracy", help="run directories and JSON")
    p.add_argument("--img", default="docs/img", help="where the two PNGs go")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="sequences per optimizer step (one micro-batch)")
    p.add_argument("--refresh", type=int, default=10, help="sparsity.refresh_interval")
    p.add_argument("--eval-interval", type=int, default=15)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--decay", default="search", help="masked-decay λ for the full recipe, or 'search'")
    p.add_argument("--search-steps", type=int, default=30)
    p.add_argument("--search-decays", default="2e-5,6e-5,2e-4,6e-4")
    p.add_argument("--noise-seed", type=int, default=4321, help="train.seed of the repeat runs (0: none)")
    p.add_argument("--jobs", type=int, default=2, help="runs at once (the CPU box has 2 cores)")
    p.add_argument("--reuse", action="store_true", help="keep finished runs in --out instead of rerunning")
    p.add_argument("--plot-only", action="store_true", help="only read finished runs, plot and tabulate")
    args = p.parse_args(argv)

    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    reuse = args.reuse or args.plot_only
    args.reuse = reuse
    search = None
    if args.decay == "search":
        decay, search = search_decay(args, out)
    else:
        decay = float(args.decay)
    plan = run_plan(decay, args.noise_seed)
    jobs = []
    for name, extra in plan.items():
        if reuse and finished(out / name, args.steps):
            continue
        if args.plot_only:
            raise SystemExit(f"--plot-only: {out / name} has no finished run of {args.steps} steps")
        cmd = [sys.executable, "-m", "megasparse", "train", args.config, *common_overrides(args), *extra]
        jobs.append((name, [*cmd, f"logging.out_dir={out / name}"], out / f"{name}.log"))
    wall = run_all(jobs, args.jobs)

    from megasparse.config import load_config

    ff = load_config(str(ROOT / args.config), ["sparsity.enabled=true"]).sparsity.dense_finetune_fraction
    results = {
        "device": f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared), fp32",
        "config": args.config,
        "overrides": common_overrides(args),
        "decay": decay,
        "decay_source": "search" if search and search.get("recommended") is not None else args.decay,
        "decay_search": search,
        "refresh": args.refresh,
        "switch_step": int(round(args.steps * (1.0 - ff))),
        "runs": {},
        "curves": {},
        "wall_s": wall,
    }
    for name, extra in plan.items():
        c = curves(read_metrics(out / name))
        results["curves"][name] = c
        results["runs"][name] = {"overrides": extra, "final_val_loss": c["val"][-1][1]}
    for name, r in results["runs"].items():  # each run against the dense run of its own initialisation
        r["anchor"] = f"dense_seed{args.noise_seed}" if name.endswith(f"_seed{args.noise_seed}") else "dense"
        dense = results["runs"][r["anchor"]]["final_val_loss"]
        r["gap_vs_dense"] = (r["final_val_loss"] - dense) / dense
    (out / "sparse24_accuracy.json").write_text(json.dumps(results, indent=1))
    img = ROOT / args.img
    img.mkdir(parents=True, exist_ok=True)
    title = f"cpu_toy, tp=1, seq {args.seq}, batch {args.batch}, {args.steps} steps, λ={decay:g}"
    plot(results, img / "sparse24_accuracy.png", img / "sparse24_flip_rate.png", title)

    if search:
        print(f"decay-search ({search['steps']} steps): dense flip rate {search['dense']:.4g}")
        for lam, mu in search["ratios"].items():
            print(f"  λ={float(lam):<8g} μ={mu:.3f}")
        print(f"  -> λ={decay:g} ({results['decay_source']})")
    print(f"\n{results['device']}; anchor: the dense run of the same seed, same steps and data")
    print(f"{'run':<15} {'final val loss':>15} {'gap vs anchor':>14} {'anchor':>15} {'mean flip':>10}")
    for name, r in results["runs"].items():
        fl = [v for _, v in results["curves"][name]["flip"]]
        mean_flip = f"{sum(fl) / len(fl):.4f}" if fl else "-"
        gap = f"{100 * r['gap_vs_dense']:+.2f}%"
        print(f"{name:<15} {r['final_val_loss']:>15.4f} {gap:>14} {r['anchor']:>15} {mean_flip:>10}")
    ok = results["runs"]["fst"]["gap_vs_dense"] <= 0.03
    print(f"full recipe within 3% of dense: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
