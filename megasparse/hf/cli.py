"""``megasparse hf import HF_DIR OUT_DIR`` and ``megasparse hf export CKPT_DIR OUT_DIR [--dtype bf16|fp32]``."""

from __future__ import annotations

import argparse
import sys

from megasparse.configbase import ConfigError


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="megasparse hf", description="Hugging Face Llama-family import and export.")
    sub = p.add_subparsers(dest="cmd", required=True)
    imp = sub.add_parser("import", help="an HF directory -> a megasparse run directory (config.yaml + step-0)")
    imp.add_argument("hf_dir")
    imp.add_argument("out_dir")
    exp = sub.add_parser("export", help="a megasparse checkpoint (any layout) -> an HF directory")
    exp.add_argument("ckpt_dir", help="a run's out_dir, an import's directory or a step-N directory")
    exp.add_argument("out_dir")
    exp.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    exp.add_argument("--shard-gb", type=float, default=4.0, help="largest safetensors shard, GiB")
    a = p.parse_args(argv)
    from megasparse.hf import checkpoints

    try:
        if a.cmd == "import":
            out = checkpoints.import_hf(a.hf_dir, a.out_dir)
            print(f"imported {a.hf_dir} -> {out}: train with `megasparse train {out}/config.yaml data.prefix=...`")
        else:
            out = checkpoints.export_hf(a.ckpt_dir, a.out_dir, a.dtype, int(a.shard_gb * (1 << 30)))
            print(f"exported {a.ckpt_dir} -> {out} ({a.dtype})")
    except ConfigError as e:
        print(f"megasparse: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0
