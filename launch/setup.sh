#!/usr/bin/env bash
# Create .venv and install megasparse with its test tools. Idempotent; used by the quickstart and by CI.
#   bash launch/setup.sh
# On a machine with the CPU torch 2.13 wheel on local disk, `pip install torch==2.13.0` takes it; on a GPU
# machine an existing torch (>= 2.11) is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
python -m pip install -q -e ".[dev]"
python -c "import torch, megatron.core, megasparse; print(f'megasparse ready: torch {torch.__version__}, python', \
__import__('sys').version.split()[0])"
