#!/usr/bin/env bash
# make bench: the benchmark suite, with a Ceph RADOS Gateway on 127.0.0.1 for the S3 ratios when
# radosgw is installed (scripts/install-system-deps.sh) and S3_ENDPOINT_URL is not already set.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
free_port() { "$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
if [ -z "${S3_ENDPOINT_URL:-}" ] && command -v radosgw >/dev/null; then
  export STATE_DIR=$(mktemp -d /tmp/rgw-bench-XXXX) RGW_PORT=$(free_port) MON_PORT=$(free_port)
  export RGW_SECRET_KEY=bench-secret AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=bench-secret
  export AWS_DEFAULT_REGION=us-east-1
  # The 2 GB S3 pairs keep a promoted step and a raw copy in the memstore OSD's RAM at once.
  export MEMSTORE_BYTES=${MEMSTORE_BYTES:-12884901888}
  trap '"$here/scripts/ceph/stop-rgw.sh" >/dev/null 2>&1 || true' EXIT
  endpoint=$("$here/scripts/ceph/start-rgw.sh" | tail -n 1)
  export S3_ENDPOINT_URL=${endpoint#*=}
fi
cd "$here"
PYTHONWARNINGS=ignore "$py" -m bench.suite "$@"
# Data preparation: pretrain prepare-data against the raw tokenizer encode (bench/prepare_numbers.py).
PYTHONWARNINGS=ignore "$py" -m bench.prepare_numbers 48 | tee "$here/bench/results/prepare-$(date +%F).json"
