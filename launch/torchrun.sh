#!/usr/bin/env bash
# Launch `megarl train` (or `megarl sft`) on this node with torchrun.
#
#   launch/torchrun.sh RECIPE [section.key=value ...]
#
# One node:   launch/torchrun.sh recipes/grpo_tiny_cpu.yaml trainer.total_steps=5
# One node of several (run it on every node, with the same MASTER_ADDR/MASTER_PORT and its own NODE_RANK):
#             NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 launch/torchrun.sh RECIPE ...
#
# Environment (all optional):
#   NPROC_PER_NODE  ranks on this node; default: the number of visible GPUs, else 1
#   NNODES          nodes in the job (default 1);  NODE_RANK  this node's index (default 0; node 0 hosts the
#                   rendezvous); RDZV_IS_HOST=1/0 says instead whether this node is MASTER_ADDR (Slurm script)
#   MASTER_ADDR     host of the c10d rendezvous, the first node (default 127.0.0.1);  MASTER_PORT (default 29500)
#   LOCAL_ADDR      this node's address as the other nodes reach it (default: torchrun's choice, the hostname)
#   RDZV_ID         rendezvous id shared by the nodes of one job (default megarl)
#   MEGARL_COMMAND  train (default) or sft
#   LOG_DIR         per-rank stdout/stderr go to LOG_DIR/<rdzv id>/attempt_N/<local rank>/ (default: logs
#                   under the run directory if RUN_DIR is set, else ./logs); local rank 0 is also shown here
#   TORCHRUN        the torchrun executable (default: torchrun on PATH)
#
# trainer.nnodes and trainer.n_gpus_per_node are set from NNODES and NPROC_PER_NODE, so the recipe always plans for
# the ranks that are launched.
set -euo pipefail

usage() {
  sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'
}

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
  usage
  exit 2
fi
recipe="$1"
shift
if [[ ! -f "$recipe" ]]; then
  echo "launch/torchrun.sh: recipe not found: $recipe" >&2
  exit 2
fi

gpu_count() {
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --list-gpus 2>/dev/null | wc -l
  else
    echo 0
  fi
}

nproc_per_node="${NPROC_PER_NODE:-}"
if [[ -z "$nproc_per_node" ]]; then
  nproc_per_node="$(gpu_count)"
  if [[ "$nproc_per_node" -lt 1 ]]; then
    nproc_per_node=1
  fi
fi
nnodes="${NNODES:-1}"
node_rank="${NODE_RANK:-0}"
master_addr="${MASTER_ADDR:-127.0.0.1}"
master_port="${MASTER_PORT:-29500}"
rdzv_id="${RDZV_ID:-megarl}"
command_name="${MEGARL_COMMAND:-train}"
torchrun_bin="${TORCHRUN:-torchrun}"
log_dir="${LOG_DIR:-${RUN_DIR:+$RUN_DIR/logs}}"
log_dir="${log_dir:-logs}"
mkdir -p "$log_dir"

# Threads per rank: the cores of this node shared by its ranks (torchrun would otherwise default to 1).
if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
  cores="$(nproc 2>/dev/null || echo 1)"
  threads=$(( cores / nproc_per_node ))
  export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))
fi

args=(
  --nnodes="$nnodes"
  --nproc-per-node="$nproc_per_node"
  --node-rank="$node_rank"
  --rdzv-backend=c10d
  --rdzv-endpoint="$master_addr:$master_port"
  --rdzv-id="$rdzv_id"
  --max-restarts=0
  --log-dir="$log_dir"
  --redirects=3
  --tee=3
  --local-ranks-filter=0
)
if [[ -n "${LOCAL_ADDR:-}" ]]; then
  args+=(--local-addr="$LOCAL_ADDR")
fi
# The node at MASTER_ADDR hosts the rendezvous store. Say which one it is (RDZV_IS_HOST=1/0, or NODE_RANK 0 when
# NODE_RANK is given) rather than let torchrun guess from host names (two "nodes" on one machine share a name).
is_host="${RDZV_IS_HOST:-}"
if [[ -z "$is_host" && "$nnodes" -gt 1 && -n "${NODE_RANK:-}" ]]; then
  is_host=$(( node_rank == 0 ? 1 : 0 ))
fi
if [[ -n "$is_host" ]]; then
  args+=(--rdzv-conf="is_host=$is_host")
fi

echo "launch/torchrun.sh: node $node_rank of $nnodes, $nproc_per_node ranks, rendezvous $master_addr:$master_port," \
  "rank logs in $log_dir" >&2
exec "$torchrun_bin" "${args[@]}" -m megarl.cli "$command_name" "$recipe" "$@" \
  "trainer.nnodes=$nnodes" "trainer.n_gpus_per_node=$nproc_per_node"
