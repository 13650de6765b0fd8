#!/usr/bin/env bash
# Train on one node: one process per GPU (or per CPU rank with gloo), started by torchrun.
#
#   launch/torchrun.sh NPROC CONFIG.yaml [section.key=value ...]
#   DRY_RUN=1 launch/torchrun.sh 4 configs/cpu_toy.yaml parallel.tp=2   # print the command, run nothing
#
# Environment: TORCHRUN overrides the launcher (default: torchrun, else python3 -m torch.distributed.run);
# OMP_NUM_THREADS defaults to 1 (several ranks share the cores). --standalone picks a free rendezvous port,
# so two jobs on one machine do not collide.
set -euo pipefail

die() { echo "torchrun.sh: $*" >&2; exit 2; }
[[ $# -ge 2 ]] || die "usage: launch/torchrun.sh NPROC CONFIG.yaml [section.key=value ...]"
nproc=$1 config=$2
shift 2
[[ $nproc =~ ^[1-9][0-9]*$ ]] || die "NPROC must be a positive integer, got '$nproc'"
[[ -f $config ]] || die "config file '$config' does not exist; see configs/ for examples"

if [[ -n ${TORCHRUN:-} ]]; then
  read -r -a launcher <<<"$TORCHRUN"
elif command -v torchrun >/dev/null 2>&1; then
  launcher=(torchrun)
else
  launcher=(python3 -m torch.distributed.run)
fi

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# NVLink multicast (NVLS) stays off: on shared hosts a program using it can take the GPUs out of service.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}

cmd=("${launcher[@]}" --standalone --nnodes 1 --nproc_per_node "$nproc" -m megasparse train "$config" "$@")
if [[ ${DRY_RUN:-0} == 1 ]]; then
  line=$(printf ' %q' "${cmd[@]}")
  echo "${line:1}"
  exit 0
fi
exec "${cmd[@]}"
