#!/usr/bin/env bash
# The prepared single-GPU check: install the carried wheels, run tests/gpu/, write one JSON report.
#
#   scripts/gpu-check.sh [--cpu] [--wheels DIR] [--target DIR] [--report FILE] [--workdir DIR]
#   scripts/gpu-check.sh --multi-node [--cpu] [--wheels DIR] [--target DIR]     (on every node at once)
#
# On the GPU machine (one GPU, Python 3.12 with a CUDA torch, no internet): installs what it lacks
# from DIR (default wheels/, made here by scripts/fetch-gpu-wheels.sh: the newest megatron-core
# and NVRx, ...) into TARGET (default .gpu-check/site, put first on PYTHONPATH), then runs
# tests/gpu/ (each check in its own process under a time limit, 440 s in all: the check must finish in
# under 8 minutes; GPU_CHECK_LIMIT_S, default 450 s on CUDA, bounds pytest). Every test skips
# cleanly without CUDA. The report is rewritten after every test: a run cut short keeps what ran.
# --cpu: the dry run (part of make test): the same entry points at CPU size, with the project's
# own environment (.venv when present) and nothing installed.
# The report (default gpu-check-report.json) names the versions that ran, each test's outcome and
# its figures; each check's log and result are copied next to it (the work directory, default
# .gpu-check/work, keeps the checkpoints); the exit status is pytest's.
# --multi-node: instead of tests/gpu/, the all-reduce bus bandwidth across the job's nodes
# (pretrain.platform.allreduce_check under torchrun: NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT
# from the environment, one rank per GPU; MIN_BUSBW_GBS fails it below that); with --cpu, two
# local gloo ranks (its dry run, in make test). With the device tool:
#   scripts/gpu-check.sh --report $OUT/gpu-check-report.json     (carry: wheels)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
MODE=cuda
MULTI_NODE=0
WHEELS=wheels
TARGET=.gpu-check/site
REPORT=gpu-check-report.json
WORKDIR=.gpu-check/work
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) MODE=cpu ;;
    --multi-node) MULTI_NODE=1 ;;
    --wheels) WHEELS=$2; shift ;;
    --target) TARGET=$2; shift ;;
    --report) REPORT=$2; shift ;;
    --workdir) WORKDIR=$2; shift ;;
    *) echo "gpu-check: unknown argument $1; fix: [--cpu] [--multi-node] [--wheels DIR] [--target DIR] [--report FILE] [--workdir DIR]" >&2; exit 2 ;;
  esac
  shift
done
if [ "$MODE" = cpu ] && [ -x .venv/bin/python ]; then
  PYTHON=${PYTHON:-.venv/bin/python}
else
  PYTHON=${PYTHON:-python3}
fi
started=$(date +%s)
if [ "$MODE" = cuda ]; then
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "gpu-check: no wheels in $WHEELS; fix: run scripts/fetch-gpu-wheels.sh where there is internet and carry $WHEELS/" >&2
    exit 2
  fi
  echo "gpu-check: wheels in $WHEELS: $(du -ch "$WHEELS"/*.whl | tail -1 | cut -f1)"
  PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore "$PYTHON" scripts/install_carried_wheels.py "$WHEELS" "$TARGET"
  export PYTHONPATH="$REPO/$TARGET:$REPO${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$REPO/$TARGET/bin:$PATH"
  echo "gpu-check: installed in $(( $(date +%s) - started )) s"
else
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ "$MULTI_NODE" = 1 ]; then
  if [ "$MODE" = cpu ]; then
    ranks=(--standalone --nproc-per-node=2)
    size=(--mib 8 --iters 5)
  else
    : "${NNODES:?gpu-check --multi-node: set NNODES, NODE_RANK, MASTER_ADDR (and MASTER_PORT) on every node}"
    ranks=(--nnodes="$NNODES" --node-rank="${NODE_RANK:?set NODE_RANK}" --master-addr="${MASTER_ADDR:?set MASTER_ADDR}"
           --master-port="${MASTER_PORT:-29500}" --nproc-per-node="$(nvidia-smi -L | wc -l)")
    size=()
  fi
  exec "$PYTHON" -m torch.distributed.run "${ranks[@]}" -m pretrain.platform.allreduce_check "${size[@]}" \
    ${MIN_BUSBW_GBS:+--min-busbw-gbs "$MIN_BUSBW_GBS"}
fi
mkdir -p "$WORKDIR" "$(dirname "$REPORT")"
export GPU_CHECK_MODE=$MODE GPU_CHECK_REPORT=$REPORT GPU_CHECK_WORKDIR=$WORKDIR PYTHONWARNINGS=ignore
rc=0
if [ "$MODE" = cuda ]; then LIMIT=${GPU_CHECK_LIMIT_S:-450}; else LIMIT=${GPU_CHECK_LIMIT_S:-900}; fi
timeout --kill-after=10 "$LIMIT" "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts="-ra" tests/gpu || rc=$?
# Each check's log and result next to the report (the checkpoints stay in the work directory).
for f in "$WORKDIR"/*.log "$WORKDIR"/*.json; do
  if [ -f "$f" ] && [ "$(dirname "$(realpath "$f")")" != "$(dirname "$(realpath "$REPORT")")" ]; then
    cp "$f" "$(dirname "$REPORT")/"
  fi
done
echo "gpu-check ($MODE): exit $rc after $(( $(date +%s) - started )) s; report: $REPORT"
exit "$rc"
