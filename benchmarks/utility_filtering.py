"""Does token filtering help held-out loss? Dense vs Rho-1 loss_mask vs Collider vs a random-selection ablation.

    python benchmarks/utility_filtering.py                     # build the n-gram, train all runs, plot, table
    python benchmarks/utility_filtering.py --plot-only         # re-read finished runs, plot and tabulate
    python benchmarks/utility_filtering.py --runs dense@1234 collider@1234 --jobs 1

Each run is one single-process ``megasparse train`` (OMP_NUM_THREADS=1, at most ``--jobs`` at once) of
configs/utility_cpu.yaml at equal optimizer steps; the filtered runs score tokens with excess loss against an
order-3 Kneser-Ney n-gram fitted on the bundled Milton corpus (``megasparse ref ngram``). Every run evaluates the
same fixed validation windows, so differences between runs are paired. Compares every run against the dense
anchor (mean over its seeds) in the same invocation; prints a table last, writes JSON (naming the device) and
the figure docs/img/utility_filtering.png. ``--src DIR`` runs the trainer from a frozen copy of the package
(e.g. ``git archive HEAD``) so a shared working tree being edited mid-comparison cannot mix code versions.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: variant -> trainer overrides ({ngram} is the counts file). Filtered variants keep --keep of the tokens.
VARIANTS: dict[str, list[str]] = {
    "dense": ["filter.mode=off"],
    "loss_mask": [
        "filter.mode=loss_mask",
        "filter.scorer=excess",
        "filter.reference=ngram",
        "filter.ngram_path={ngram}",
    ],
    "collider": ["filter.mode=collider", "filter.scorer=excess", "filter.reference=ngram", "filter.ngram_path={ngram}"],
    "collider_random": ["filter.mode=collider", "filter.scorer=random"],
    "collider_modelref": [
        "filter.mode=collider",
        "filter.scorer=excess",
        "filter.reference=model",
        "filter.ref_checkpoint={ref_ckpt}",
    ],
}
LABELS = {
    "dense": "dense (filter off)",
    "loss_mask": "loss_mask, n-gram excess",
    "collider": "collider, n-gram excess",
    "collider_random": "collider, random (ablation)",
    "collider_modelref": "collider, model-ref excess",
}
COLORS = {
    "dense": "black",
    "loss_mask": "tab:blue",
    "collider": "tab:red",
    "collider_random": "tab:gray",
    "collider_modelref": "tab:green",
}
#: the reference model for collider_modelref: same architecture, trained on the Milton corpus (not plotted)
REF_RUN = "milton_ref"
DEFAULT_RUNS = ["dense@1234", "collider@1234", "loss_mask@1234", "collider_random@1234", "dense@2345", "collider@2345"]


def device_name() -> str:
    """CPU model, since every run here is a one-thread CPU process."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"cpu: {line.split(':', 1)[1].strip()} (1 thread per run)"
    except OSError:
        pass
    return f"cpu: {platform.processor() or platform.machine()} (1 thread per run)"


def parse_run(spec: str) -> tuple[str, int]:
    name, _, seed = spec.partition("@")
    if name not in VARIANTS and name != REF_RUN:
        raise SystemExit(f"--runs {spec}: unknown variant {name!r}; use one of {', '.join(VARIANTS)}")
    return name, int(seed or 1234)


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def finished(run_dir: Path, steps: int) -> bool:
    recs = read_metrics(run_dir / "metrics.jsonl")
    return bool(recs) and recs[-1].get("step") == steps


def child_env(src: str | None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if src:
        env["PYTHONPATH"] = os.pathsep.join([src] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def megasparse_cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "megasparse", *args]


def build_ngram(a: argparse.Namespace) -> None:
    if Path(a.ngram).exists() and not a.force:
        return
    Path(a.ngram).parent.mkdir(parents=True, exist_ok=True)
    cmd = megasparse_cmd(["ref", "ngram", "--data", "builtin:milton", "--order", str(a.order), "--out", a.ngram])
    print("+", " ".join(cmd), flush=True)
    # cwd outside the repository: ``python -m`` puts the cwd first on sys.path, which would shadow --src
    subprocess.run(cmd, check=True, env=child_env(a.src), cwd=a.out)


def milton_prefix() -> str:
    from megasparse.data.builtin import builtin_paths

    return builtin_paths().reference_prefix


def train_cmd(a: argparse.Namespace, name: str, seed: int, run_dir: Path) -> list[str]:
    fmt = {"ngram": a.ngram, "ref_ckpt": a.ref_checkpoint or ""}
    if name == REF_RUN:  # Milton stands in for Shakespeare; its own validation split is evaluated
        over = ["filter.mode=off", f"data.prefix={milton_prefix()}", "checkpoint.save_at_end=true"]
    else:
        over = [o.format(**fmt) for o in VARIANTS[name]]
    over += [
        f"filter.keep_ratio={a.keep}",
        f"train.seed={seed}",
        f"train.steps={a.steps}",
        f"train.eval_interval={a.eval_interval}",
        f"train.eval_batches={a.eval_batches}",
        f"logging.out_dir={run_dir}",
        *a.override,
    ]
    return megasparse_cmd(["train", str(Path(a.config).resolve()), *over])


def run_all(a: argparse.Namespace, runs: list[tuple[str, int]]) -> dict[str, dict]:
    """Start the runs ``--jobs`` at a time; returns per-run status (rc, wall seconds, last error line)."""
    pending = [r for r in runs]
    live: dict[str, tuple[subprocess.Popen, float, Path]] = {}
    status: dict[str, dict] = {}
    while pending or live:
        while pending and len(live) < a.jobs:
            name, seed = pending.pop(0)
            key = f"{name}@{seed}"
            run_dir = Path(a.out) / f"{name}_s{seed}"
            if finished(run_dir, a.steps) and not a.force:
                status[key] = {"rc": 0, "skipped": "already finished"}
                continue
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "metrics.jsonl").unlink(missing_ok=True)
            cmd = train_cmd(a, name, seed, run_dir)
            (run_dir / "command.txt").write_text(" ".join(cmd) + "\n")
            print(f"start {key}: {' '.join(cmd[3:])}", flush=True)
            log = open(run_dir / "train.log", "w")
            live[key] = (
                subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(a.src), cwd=a.out),
                time.time(),
                run_dir,
            )
        time.sleep(2.0)
        for key in [k for k, (p, _, _) in live.items() if p.poll() is not None]:
            proc, t0, run_dir = live.pop(key)
            lines = (run_dir / "train.log").read_text().strip().splitlines()
            err = next((ln for ln in reversed(lines) if "error" in ln.lower()), None) if proc.returncode else None
            status[key] = {"rc": proc.returncode, "wall_s": round(time.time() - t0, 1), "error": err}
            print(
                f"done  {key}: rc {proc.returncode} in {time.time() - t0:.0f}s" + (f" ({err})" if err else ""),
                flush=True,
            )
    return status


def grad_tokens_per_step(cfg_path: Path) -> int:
    """Tokens whose loss reaches the gradient in one optimizer step (kept tokens when filtering)."""
    from megasparse.config import load_config
    from megasparse.filtering.selection import kept_total

    cfg = load_config(str(cfg_path))
    s, b, f = cfg.model.seq_length, cfg.train.micro_batch_size, cfg.filter
    mbs_per_step = cfg.train.global_batch_size // b  # single process: dp = 1, no SP
    if f.mode == "off":
        return s * b * mbs_per_step
    return kept_total((s, b), f.keep_ratio, f.granularity, 1) * mbs_per_step


def collect(a: argparse.Namespace, runs: list[tuple[str, int]], status: dict[str, dict]) -> dict[str, dict]:
    out = {}
    for name, seed in runs:
        key, run_dir = f"{name}@{seed}", Path(a.out) / f"{name}_s{seed}"
        recs = read_metrics(run_dir / "metrics.jsonl")
        entry = {"variant": name, "seed": seed, "dir": str(run_dir), **status.get(key, {})}
        if recs and (run_dir / "config.yaml").exists():
            gt = grad_tokens_per_step(run_dir / "config.yaml")
            ev = [r for r in recs if "val_loss" in r]
            entry.update(
                grad_tokens_per_step=gt,
                steps=[r["step"] for r in recs],
                train_loss=[r["loss"] for r in recs],
                step_time_s=[r["step_time_s"] for r in recs],
                val_steps=[r["step"] for r in ev],
                val_loss=[r["val_loss"] for r in ev],
            )
        out[key] = entry
    return out


def interp(x: float, xs: list[float], ys: list[float]) -> float | None:
    """Linear interpolation of ys(xs) at x (None outside the range)."""
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y0
    return ys[-1]


def mean(v: list[float]) -> float:
    return sum(v) / len(v)


def steady_step_time(r: dict) -> float:
    """Mean step time without the first steps (allocator and thread-pool warm-up)."""
    t = r["step_time_s"]
    return mean(t[5:] if len(t) > 10 else t)


def dense_anchor(res: dict[str, dict]) -> tuple[list[int], list[float], list[float]] | None:
    """(eval steps, mean dense val loss, half the min-max spread over dense seeds) on the common eval steps."""
    dense = [r for r in res.values() if r["variant"] == "dense" and r.get("val_loss")]
    if not dense:
        return None
    steps = sorted(set.intersection(*(set(r["val_steps"]) for r in dense)))
    per = [[dict(zip(r["val_steps"], r["val_loss"]))[s] for r in dense] for s in steps]
    return steps, [mean(v) for v in per], [(max(v) - min(v)) / 2 for v in per]


def table(res: dict[str, dict]) -> list[dict]:
    anchor = dense_anchor(res)
    dense = [r for r in res.values() if r["variant"] == "dense" and r.get("val_loss")]
    dense_gt = dense[0]["grad_tokens_per_step"] if dense else None
    dense_time = mean([steady_step_time(r) for r in dense]) if dense else None
    rows = []
    for key, r in res.items():
        row = {"run": key, "rc": r.get("rc")}
        if r.get("val_loss"):
            final = r["val_loss"][-1]
            gt_total = r["grad_tokens_per_step"] * r["steps"][-1]
            row.update(
                final_val=final,
                best_val=min(r["val_loss"]),
                train_loss_last20=mean(r["train_loss"][-20:]),
                grad_tokens=gt_total,
                step_time_s=steady_step_time(r),
            )
            if anchor:
                steps, dmean, _ = anchor
                row["d_vs_dense_final"] = final - dmean[-1]
                # dense held-out loss after the same number of gradient tokens (dense steps = gt_total / dense_gt)
                eq = interp(gt_total / dense_gt, steps, dmean)
                row["dense_at_equal_grad_tokens"] = eq
                row["d_vs_dense_equal_grad_tokens"] = None if eq is None else final - eq
                row["step_time_ratio"] = row["step_time_s"] / dense_time
        else:
            row["error"] = r.get("error") or "no metrics"
        rows.append(row)
    return rows


def plot(res: dict[str, dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(17, 5))
    styles = ["-", "--", ":", "-."]
    seen: dict[str, int] = {}
    for r in res.values():
        if not r.get("val_loss"):
            continue
        v = r["variant"]
        ls = styles[seen.get(v, 0) % len(styles)]
        seen[v] = seen.get(v, 0) + 1
        lab = f"{LABELS[v]} (seed {r['seed']})"
        gt = [s * r["grad_tokens_per_step"] / 1e3 for s in r["val_steps"]]
        ax[0].plot(r["val_steps"], r["val_loss"], ls, color=COLORS[v], label=lab, lw=1.4)
        ax[1].plot(gt, r["val_loss"], ls, color=COLORS[v], label=lab, lw=1.4)
    anchor = dense_anchor(res)
    diffs: list[float] = []
    if anchor:
        steps, dmean, half = anchor
        ax[2].fill_between(
            steps, [-h for h in half], half, color="black", alpha=0.15, label="dense seed spread (± half range)"
        )
        ax[2].axhline(0.0, color="black", lw=0.8)
        seen.clear()
        for r in res.values():
            if not r.get("val_loss") or r["variant"] == "dense":
                continue
            d = dict(zip(r["val_steps"], r["val_loss"]))
            xs = [s for s in steps if s in d]
            ls = styles[seen.get(r["variant"], 0) % len(styles)]
            seen[r["variant"]] = seen.get(r["variant"], 0) + 1
            ys = [d[s] - dmean[steps.index(s)] for s in xs]
            diffs += [y for x, y in zip(xs, ys) if x >= steps[-1] * 0.2] + list(half)
            ax[2].plot(
                xs,
                ys,
                ls,
                color=COLORS[r["variant"]],
                label=f"{LABELS[r['variant']]} (seed {r['seed']})",
                lw=1.4,
            )
    ax[0].set(xlabel="optimizer step", ylabel="held-out loss (nats/token)", title="held-out loss vs step")
    ax[1].set(
        xlabel="tokens that received gradient (thousands)",
        ylabel="held-out loss (nats/token)",
        title="held-out loss vs gradient tokens",
    )
    ax[2].set(xlabel="optimizer step", ylabel="held-out loss − dense mean (nats)", title="difference to dense")
    vals = [v for r in res.values() for v in r.get("val_loss", [])]
    if vals:  # the first evals (near-uniform predictions) would squash the part of the curves that differs
        for i in (0, 1):
            ax[i].set_ylim(min(vals) - 0.05, min(max(vals), min(vals) + 2.0))
    if diffs:
        lim = max(0.05, 1.15 * max(abs(d) for d in diffs))
        ax[2].set_ylim(-lim, lim)
    for x in ax:
        x.grid(alpha=0.3)
    ax[0].legend(fontsize=8)
    ax[2].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def fmt(v, spec: str) -> str:
    """``format(v, spec)``, or a dash padded to the same width when there is no value."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-".rjust(int("".join(c for c in spec.split(".")[0] if c.isdigit()) or 1))
    return format(v, spec)


def heading(title: str, columns: str) -> None:
    print(f"\n{title}\n{columns}\n{'-' * len(columns)}")


def print_table(rows: list[dict], device: str) -> None:
    heading(
        f"held-out loss at the last step, device {device}; Δ vs the dense anchor (mean over dense seeds)",
        f"{'run':<24} {'final val':>9} {'Δ dense':>8} {'best val':>9} {'grad tok':>9} {'dense@eq tok':>12} "
        f"{'Δ@eq tok':>8} {'train(last20)':>13} {'s/step':>7} {'× dense':>7}",
    )
    for r in rows:
        if "final_val" not in r:
            print(f"{r['run']:<24} failed (rc {r.get('rc')}): {r.get('error')}")
            continue
        print(
            f"{r['run']:<24} {r['final_val']:>9.4f} {fmt(r.get('d_vs_dense_final'), '+8.4f')} {r['best_val']:>9.4f} "
            f"{r['grad_tokens'] / 1e3:>8.0f}k {fmt(r.get('dense_at_equal_grad_tokens'), '12.4f')} "
            f"{fmt(r.get('d_vs_dense_equal_grad_tokens'), '+8.4f')} {r['train_loss_last20']:>13.4f} "
            f"{r['step_time_s']:>7.2f} {fmt(r.get('step_time_ratio'), '7.2f')}"
        )


def param_group(name: str) -> str:
    """embedding, layers.N.attn, layers.N.mlp (norms included with their block), or the head."""
    parts = name.split(".")
    if parts[0] == "layers":
        return f"layers.{parts[1]}.{'attn' if parts[2].startswith('attn') else 'mlp'}"
    return parts[0]


def grad_check(a: argparse.Namespace) -> list[dict]:
    """Step-1 gradients of loss_mask, collider and an explicit masked-loss autograd, per parameter group.

    Same init, same batch, same n-gram selection: loss_mask must equal the explicit masked loss exactly, while
    Collider (gradients flow only among kept tokens, DESIGN.md) may differ once a gradient crosses attention.
    """
    import torch

    from megasparse.config import load_config
    from megasparse.ops.compact import KeepHolder
    from megasparse.train import Trainer

    torch.set_num_threads(1)
    base = [
        f"filter.keep_ratio={a.keep}",
        "filter.scorer=excess",
        "filter.reference=ngram",
        f"filter.ngram_path={a.ngram}",
        "train.eval_interval=0",
        f"logging.out_dir={a.out}/grad_check",
        *a.override,
    ]

    def trainer(mode: str) -> Trainer:
        return Trainer(load_config(a.config, [*base, f"filter.mode={mode}"]))

    def grads(tr: Trainer) -> dict[str, torch.Tensor]:
        return {n: p.grad.double() for n, p in tr.model.named_parameters() if p.grad is not None}

    got = {}
    for mode in ("loss_mask", "collider"):
        tr = trainer(mode)
        tr.compute_gradients()
        got[mode] = grads(tr)
    tr = trainer("loss_mask")  # the explicit reference: plain autograd through the masked, kept-normalised loss
    tr.dp_opt.zero_grad()
    total = 0.0
    for i, batch in enumerate(tr._microbatches(tr.train_ds, 0, tr.num_mb)):
        out = tr.model(batch.ids, batch.targets, KeepHolder())
        total = total + (out * tr.filter.select(out, batch, tr.step, i).loss_mask.reshape(-1)).sum()
    (total / (tr.filter.kept_rows * tr.num_mb)).backward()
    ref = grads(tr)
    rows: dict[str, dict] = {}
    for n, g in ref.items():
        r = rows.setdefault(param_group(n), {"ref": 0.0, "lm_err": 0.0, "co": 0.0, "co_err": 0.0})
        r["ref"] += g.pow(2).sum().item()
        r["lm_err"] += (got["loss_mask"][n] - g).pow(2).sum().item()
        r["co"] += got["collider"][n].pow(2).sum().item()
        r["co_err"] += (got["collider"][n] - g).pow(2).sum().item()
    rows["all"] = {k: sum(r[k] for r in rows.values()) for k in ("ref", "lm_err", "co", "co_err")}
    return [
        {
            "group": k,
            "norm_loss_mask": math.sqrt(r["ref"]),
            "rel_err_loss_mask": math.sqrt(r["lm_err"] / r["ref"]),
            "norm_ratio_collider": math.sqrt(r["co"] / r["ref"]),
            "rel_diff_collider": math.sqrt(r["co_err"] / r["ref"]),
        }
        for k, r in rows.items()
    ]


def print_grad_check(rows: list[dict]) -> None:
    heading(
        "step-1 gradients vs the explicit masked-loss reference (same batch, same selection)",
        f"{'parameters':<16} {'|g| ref':>9} {'loss_mask rel err':>17} {'collider |g|/ref':>16} "
        f"{'collider rel diff':>17}",
    )
    for r in rows:
        print(
            f"{r['group']:<16} {r['norm_loss_mask']:>9.4f} {r['rel_err_loss_mask']:>17.2e} "
            f"{r['norm_ratio_collider']:>16.3f} {r['rel_diff_collider']:>17.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs" / "utility_cpu.yaml"))
    p.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, help="variant@seed ...; variants: " + ", ".join(VARIANTS))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument("--eval-batches", type=int, default=10)
    p.add_argument("--keep", type=float, default=0.6)
    p.add_argument("--order", type=int, default=3, help="n-gram order of the Milton reference")
    p.add_argument("--out", default=str(REPO / "runs" / "utility"), help="run directories, n-gram, JSON")
    p.add_argument("--ngram", default=None, help="counts file (default OUT/milton_ngram{order}.npz)")
    p.add_argument(
        "--ref-checkpoint", default=None, help="Milton-trained run dir for collider_modelref (default: train one)"
    )
    p.add_argument("--ref-seed", type=int, default=4321, help="init seed of the Milton reference model")
    p.add_argument("--jobs", type=int, default=2, help="trainings at once (each one thread)")
    p.add_argument("--src", default=None, help="run the trainer from this copy of the package (PYTHONPATH)")
    p.add_argument("--force", action="store_true", help="rerun finished runs and rebuild the n-gram")
    p.add_argument("--plot-only", action="store_true", help="only read finished runs, plot and tabulate")
    p.add_argument("--grad-check", action="store_true", help="also compare step-1 gradients (loss_mask, collider)")
    p.add_argument("--img", default=str(REPO / "docs" / "img" / "utility_filtering.png"))
    p.add_argument("--json", default=None, help="default OUT/utility_filtering.json")
    p.add_argument("override", nargs="*", help="extra trainer overrides for every run (key.sub=value)")
    a = p.parse_args(argv)
    a.out = str(Path(a.out).resolve())
    a.ngram = str(Path(a.ngram or Path(a.out) / f"milton_ngram{a.order}.npz").resolve())
    a.src = str(Path(a.src).resolve()) if a.src else None
    if a.src:  # this process imports the package too (config parsing, --grad-check): use the same copy
        sys.path.insert(0, a.src)
    runs = [parse_run(s) for s in a.runs]
    train_ref = any(n == "collider_modelref" for n, _ in runs) and not a.ref_checkpoint
    if train_ref:  # train the Milton reference first (same architecture and steps), then filter against it
        a.ref_checkpoint = str(Path(a.out) / f"{REF_RUN}_s{a.ref_seed}")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    status: dict[str, dict] = {}
    if not a.plot_only:
        build_ngram(a)
        if train_ref:
            status = run_all(a, [(REF_RUN, a.ref_seed)])
            if status[f"{REF_RUN}@{a.ref_seed}"]["rc"]:
                raise SystemExit(f"training the Milton reference failed; see {a.ref_checkpoint}/train.log")
        status.update(run_all(a, runs))
    checks = grad_check(a) if a.grad_check else []
    res = collect(a, runs, status)
    rows = table(res)
    device = device_name()
    title = (
        f"{Path(a.config).name}: {a.steps} steps, keep {a.keep}, order-{a.order} Milton n-gram reference, "
        f"held-out = fixed {a.eval_batches} eval batches | {device}"
    )
    plot(res, a.img, title)
    js = a.json or str(Path(a.out) / "utility_filtering.json")
    with open(js, "w") as f:
        json.dump(
            {
                "device": device,
                "config": a.config,
                "steps": a.steps,
                "keep": a.keep,
                "order": a.order,
                "eval_interval": a.eval_interval,
                "eval_batches": a.eval_batches,
                "grad_check": checks,
                "rows": rows,
                "runs": res,
            },
            f,
            indent=1,
        )
    print(f"wrote {js}")
    if checks:
        print_grad_check(checks)
    print_table(rows, device)
    return 0 if all(r.get("rc") in (0, None) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
