#!/usr/bin/env bash
# Launch pretrain_gpt.py on one node with torchrun.
#   scripts/launch_torchrun.sh NPROC [--config FILE] [section.key=value ...]
# Example (CPU, 8 ranks, full PTD-P):
#   scripts/launch_torchrun.sh 8 parallel.tp_size=2 parallel.pp_size=2 parallel.vp_size=2 \
#       parallel.schedule=interleaved parallel.distributed_optimizer=true
# Multi-node: set NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT in the environment of every node (and
# GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME where the host name does not resolve to the interface to use).
# Stopping: TERM or INT to torchrun (this script execs it) stops every rank after the current iteration with a
# checkpoint (exit 3); USR1 or kill -9 kill torchrun itself, and its ranks notice and do the same.
set -euo pipefail
if [ $# -lt 1 ] || ! [[ "$1" =~ ^[0-9]+$ ]]; then
    echo "usage: $0 NPROC [--config FILE] [section.key=value ...]" >&2
    exit 2
fi
NPROC=$1; shift
cd "$(dirname "$0")/.."
# On TERM/INT torchrun gives its ranks this long to save their checkpoint before it SIGKILLs them (default 30 s).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}
exec torchrun \
    --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" --nproc-per-node "$NPROC" \
    --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
    pretrain_gpt.py "$@"
