"""The ``megasparse`` command. Each subcommand lives next to its code and is imported lazily,
so ``megasparse --help`` and config errors stay fast."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, function, one-line help). The function takes argv (list[str]) and returns an exit code.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("megasparse.train", "main", "train a model: megasparse train CONFIG.yaml [key.sub=value ...]"),
    "preprocess": ("megasparse.data.preprocess", "main", "tokenize text/jsonl into a .bin/.idx dataset"),
    "data": ("megasparse.data.cli", "main", "variable-length data: `data lengths PREFIX` / `data longtail`"),
    "prepare-data": (
        "megasparse.data.builtin",
        "main",
        "build the bundled Shakespeare corpus, tokenizer, dataset",
    ),
    "chunkflow": (
        "megasparse.chunkflow.report",
        "main",
        "ChunkFlow's plan on a dataset: `chunkflow plan PREFIX --chunk-size C`",
    ),
    "ref": ("megasparse.filtering.cli", "main", "reference losses: `ref score` (checkpoint) / `ref ngram`"),
    "profile-comm": ("megasparse.profile.cli", "main", "record every collective/P2P of a few steps"),
    "plan": ("megasparse.parallel.planner", "main", "pipeline layer-split planner with loss/embedding cost"),
    "sparsity": ("megasparse.sparse24.cli", "main", "2:4 tools: `sparsity decay-search` (decay factor)"),
    "hf": ("megasparse.hf.cli", "main", "Hugging Face Llama/Qwen2: `hf import HF_DIR OUT` / `hf export CKPT OUT`"),
    "eval": ("megasparse.hf.inference", "eval_main", "loss and perplexity: megasparse eval MODEL --data PREFIX"),
    "generate": ("megasparse.hf.inference", "generate_main", "megasparse generate MODEL --prompt(-ids) ..."),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        parser = argparse.ArgumentParser(prog="megasparse", description=__doc__)
        sub = parser.add_subparsers(dest="cmd", metavar="COMMAND")
        for name, (_, _, help_) in COMMANDS.items():
            sub.add_parser(name, help=help_)
        parser.print_help()
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(cmd, list(COMMANDS), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        print(f"megasparse: unknown command '{cmd}'{hint}; see megasparse --help", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[cmd]
    fn = getattr(importlib.import_module(module), func)
    return int(fn(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
