#!/usr/bin/env bash
# Start one node of the Ray cluster that hosts megarl's rollout engines (rollout.mode=ray), in the foreground: the
# node lives as long as this command (stop it with SIGTERM or Ctrl-C; its Ray processes stop with it).
#
#   launch/ray_node.sh head   [ray start options ...]                    # the first engine node
#   RAY_HEAD=<head>:6379 launch/ray_node.sh worker [ray start options ...] # every other engine node
#
# then start the trainer (launch/torchrun.sh on each training node) with RAY_ADDRESS=<head>:<RAY_PORT>. Each engine
# replica takes one CPU of a node and rollout.tensor_model_parallel_size of its GPUs, so what a node offers decides
# how many replicas Ray places on it.
#
# Environment (all optional):
#   RAY_PORT   the head's port (default 6379)
#   RAY_HEAD   worker: the head's host:port (required)
#   NODE_IP    this node's address as the other nodes reach it (default: Ray's choice)
#   NUM_CPUS   CPUs this node offers (default: Ray counts the machine's);  NUM_GPUS  GPUs (default: Ray counts them)
#   RAY_BIN    the ray executable (default: ray on PATH)
set -euo pipefail

usage() {
  sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
}

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
  usage
  exit 2
fi
role="$1"
shift
ray_bin="${RAY_BIN:-ray}"
args=(start --block --disable-usage-stats)
if [[ -n "${NODE_IP:-}" ]]; then
  args+=(--node-ip-address="$NODE_IP")
fi
if [[ -n "${NUM_CPUS:-}" ]]; then
  args+=(--num-cpus="$NUM_CPUS")
fi
if [[ -n "${NUM_GPUS:-}" ]]; then
  args+=(--num-gpus="$NUM_GPUS")
fi
case "$role" in
  head)
    args+=(--head --port="${RAY_PORT:-6379}" --include-dashboard=false)
    ;;
  worker)
    if [[ -z "${RAY_HEAD:-}" ]]; then
      echo "launch/ray_node.sh: a worker needs RAY_HEAD=<head host>:<port> (the head's address)" >&2
      exit 2
    fi
    args+=(--address="$RAY_HEAD")
    ;;
  *)
    echo "launch/ray_node.sh: the role is head or worker, got '$role'" >&2
    exit 2
    ;;
esac
# a Ray node must not see the trainer's torchrun variables (a process it starts would try to join that group)
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT
echo "launch/ray_node.sh: Ray $role node${NODE_IP:+ at $NODE_IP}${NUM_CPUS:+, $NUM_CPUS CPUs}${NUM_GPUS:+, $NUM_GPUS GPUs}" >&2
exec "$ray_bin" "${args[@]}" "$@"
