"""``megasparse profile-comm CONFIG.yaml [overrides] [--steps N] [--compare-dense] [--out-dir D]``.

Runs a few training steps with every collective and P2P transfer recorded (see ``collect``), then on
rank 0 writes ``comm.json``, prints the markdown report and, with a dense comparison, ``comm.png``.
Works under torchrun with gloo (CPU) and NCCL (GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch.distributed as dist

from megasparse.config import ConfigError
from megasparse.configbase import parse_with_overrides
from megasparse.parallel import state
from megasparse.profile import report
from megasparse.profile.collect import profile


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="megasparse profile-comm",
        description="Record every collective/P2P transfer of a few training steps and report volumes.",
    )
    p.add_argument("config", nargs="?", help="YAML config (configs/*.yaml); omitted: built-in defaults")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. filter.mode=collider filter.keep_ratio=0.6")
    p.add_argument("--steps", type=int, default=None, help="steps to record (default: min(3, train.steps))")
    p.add_argument(
        "--compare-dense",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run the same config with filter.mode=off and report ratios (default: on when filtering)",
    )
    p.add_argument(
        "--time",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time each transfer (synchronises the GPU around it; default: on for CUDA runs)",
    )
    p.add_argument("--out-dir", default=None, help="where comm.json/comm.png go (default: <logging.out_dir>/profile)")
    a = parse_with_overrides(p, argv)
    if a.steps is not None and a.steps < 1:
        p.error(f"--steps {a.steps}: profile at least one step")
    if a.config is not None and "=" in a.config and not a.config.endswith((".yaml", ".yml")):
        a.overrides.insert(0, a.config)
        a.config = None
    return a


def write_outputs(doc: dict, out_dir: Path) -> list[Path]:
    """comm.json always; comm.png when the document has a dense anchor."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "comm.json"]
    with open(written[0], "w") as f:
        json.dump(doc, f, indent=1)
    meta = doc["meta"]
    if meta.get("anchor"):
        primary, anchor = meta["primary"], meta["anchor"]
        filt = report.group_records(report.run_records(doc, primary))
        dense = report.group_records(report.run_records(doc, anchor))
        lay = meta["layout"]
        title = (
            f"{primary} (keep {meta['keep_ratio']}) vs dense: tp{lay['tp']} pp{lay['pp']} dp{lay['dp']}"
            f"{' sp' if lay['sequence_parallel'] else ''}, {meta['device']}"
        )
        written.append(report.plot_comparison(filt, dense, out_dir / "comm.png", label=primary, title=title))
    return written


def main(argv: list[str] | None = None) -> int:
    a = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        doc = profile(a.config, a.overrides, a.steps, a.compare_dense, a.time)
    except ConfigError as e:
        print(f"megasparse profile-comm: error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if dist.is_initialized():
            state.destroy()
    if doc is None:  # not rank 0
        return 0
    out_dir = Path(a.out_dir) if a.out_dir else Path(doc["meta"]["config"]["logging"]["out_dir"]) / "profile"
    written = write_outputs(doc, out_dir)
    print(report.summary(doc), flush=True)
    print("wrote " + ", ".join(str(p) for p in written), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
