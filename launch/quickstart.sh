#!/usr/bin/env bash
# Fresh machine to a trained model: set up, build the bundled corpus and tokenizer, train the embedded default
# (a ~7M-parameter Llama on Shakespeare, TP=2 over 2 CPU ranks with gloo). A few minutes on 2 cores.
#   bash launch/quickstart.sh [section.key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
. .venv/bin/activate
megasparse prepare-data
bash launch/torchrun.sh 2 configs/cpu_toy.yaml "$@"
echo "metrics: runs/cpu_toy/metrics.jsonl   checkpoint: runs/cpu_toy/checkpoints/"
