"""`megasparse sparsity decay-search CONFIG.yaml [key=value ...]`: the paper's quick decay-factor test.

One short dense warm-up run measures the dense flip rate r (masks computed, never applied); one short
sparse run per candidate λ measures r'. μ = r'/r; a λ with μ in [0.60, 0.95] is feasible, μ ≥ 1 risks
an accuracy drop (flip-rate explosion). The smallest feasible λ is recommended: the weakest decay that
still keeps the sparse network's connections calmer than the dense one's, leaving the flip-rate peak high.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_DECAYS = "1e-6,6e-6,2e-5,6e-5,2e-4,6e-4"
MU_LOW, MU_HIGH = 0.60, 0.95


def flip_rate_at_end(flip_rates: list[dict], window: int) -> float:
    """Mean aggregate flip rate over the last ``window`` refreshes of a run (its r at t0)."""
    vals = []
    for d in flip_rates:
        if not d:
            continue
        vals.append(float(d["all"]) if "all" in d else sum(d.values()) / len(d))
    if not vals:
        raise RuntimeError("the run reported no flip rates; is sparsity.enabled=true and refresh_interval < steps?")
    tail = vals[-window:]
    return sum(tail) / len(tail)


def choose_decay(ratios: dict[float, float]) -> float | None:
    """Smallest λ whose μ lies in [0.60, 0.95]; None when none does."""
    feasible = [lam for lam, mu in ratios.items() if MU_LOW <= mu <= MU_HIGH]
    return min(feasible) if feasible else None


def _note(mu: float) -> str:
    return "feasible" if MU_LOW <= mu <= MU_HIGH else ("flip-rate explosion" if mu >= 1 else "")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="megasparse sparsity", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("decay-search", help="grid of masked-decay factors on a short warm-up")
    d.add_argument("config")
    d.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=200")
    d.add_argument("--decays", default=DEFAULT_DECAYS, help=f"comma list of λ (default {DEFAULT_DECAYS})")
    d.add_argument("--steps", type=int, default=None, help="warm-up steps per run (default: optim.warmup_steps)")
    d.add_argument("--window", type=int, default=3, help="refreshes averaged at the end of each run")
    d.add_argument("--json", default=None, help="write the table here as JSON")
    from megasparse.configbase import parse_with_overrides

    args = parse_with_overrides(p, argv)  # overrides anywhere, also after --decays

    from megasparse.config import ConfigError, load_config

    try:
        decays = [float(v) for v in args.decays.split(",")]
        base = load_config(args.config, args.overrides)
    except (ConfigError, ValueError) as e:
        print(f"megasparse sparsity: {e}", file=sys.stderr)
        return 2
    steps = args.steps or max(base.optim.warmup_steps, 2 * base.sparsity.refresh_interval)
    try:
        from megasparse.train import run_training
    except ImportError as e:
        print(
            f"megasparse sparsity decay-search: the trainer is not available ({e}); it needs "
            "megasparse.train.run_training(cfg) -> {'flip_rates': [...], 'losses': [...]}",
            file=sys.stderr,
        )
        return 2

    def run(overrides: list[str], tag: str) -> float:
        # The short search runs stay sparse to the end: dense fine-tuning would blank their last refreshes.
        fixed = [f"train.steps={steps}", "sparsity.enabled=true", "sparsity.dense_finetune_fraction=0"]
        # one out_dir per search run (one run per directory); a rerun moves the last search's files aside
        own = [f"logging.out_dir={Path(base.logging.out_dir) / tag}", "logging.previous_run=move_aside"]
        cfg = load_config(args.config, [*args.overrides, *fixed, *overrides, *own])
        return flip_rate_at_end(run_training(cfg)["flip_rates"], args.window)

    dense = run(["sparsity.monitor_only=true"], "dense")
    ratios = {lam: run([f"sparsity.decay={lam}"], f"decay-{lam:g}") / max(dense, 1e-12) for lam in decays}
    best = choose_decay(ratios)
    rows = [
        (lam, mu, "feasible" if MU_LOW <= mu <= MU_HIGH else ("explodes" if mu >= 1 else ""))
        for lam, mu in ratios.items()
    ]
    print(f"dense flip rate r = {dense:.4g} after {steps} steps")
    print(f"{'decay':>10} {'mu=r_sparse/r_dense':>20}  note")
    for lam, mu, note in rows:
        print(f"{lam:>10.3g} {mu:>20.3f}  {note}")
    print(f"recommended sparsity.decay={best}" if best is not None else "no decay in [0.60, 0.95]: widen --decays")
    if args.json:
        Path(args.json).write_text(json.dumps({"dense": dense, "ratios": ratios, "recommended": best, "steps": steps}))
    return 0 if best is not None else 1
