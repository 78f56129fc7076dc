#!/bin/bash
# Submit slurm/pretrain.sbatch, keeping nodes with hardware evidence out of the job.
# Usage: CONFIG=... LOCAL_NVME=... slurm/submit.sh [extra sbatch options]
# slurm/excluded-nodes.txt: one node per line with the evidence as a comment (Xid errors, ECC,
# failed NCCL tests); remove a line once the node is repaired and has passed its checks.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
excluded=$(grep -v '^\s*#' "$here/excluded-nodes.txt" 2>/dev/null | awk 'NF {print $1}' | paste -sd, - || true)
args=()
[ -n "$excluded" ] && args+=(--exclude="$excluded")
exec sbatch "${args[@]}" "$@" "$here/pretrain.sbatch"
