#!/usr/bin/env bash
# Run a command beside a throwaway single-node Ceph RGW (start-rgw.sh), stopped whatever the command did.
#   scripts/ceph/with-rgw.sh CMD [ARGS...]
# CMD sees S3_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION and RGW_BUCKET
# (created, default "soak"). PYTHON (default python3) must have boto3. Exit status: CMD's (1 if the
# RGW did not start in 3 tries: a start can fail transiently, as tests/conftest.py's s3_endpoint knows).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python3}
free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
RGW_SECRET_KEY=${RGW_SECRET_KEY:-testing}
export RGW_SECRET_KEY
# stop-rgw.sh stops the daemons by their pid files, waits for them and removes the state: on any exit
trap '"$here/stop-rgw.sh"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
for try in 1 2 3; do
  STATE_DIR=$(mktemp -d /tmp/rgw-XXXXXX)
  RGW_PORT=$(free_port)
  MON_PORT=$(free_port)
  export STATE_DIR RGW_PORT MON_PORT
  if out=$("$here/start-rgw.sh"); then
    break
  fi
  "$here/stop-rgw.sh"
  if [ "$try" = 3 ]; then
    echo "with-rgw: Ceph RGW did not start in 3 tries (see above); fix: scripts/install-system-deps.sh" >&2
    exit 1
  fi
done
S3_ENDPOINT_URL=${out##*endpoint=}
AWS_ACCESS_KEY_ID=testing
AWS_SECRET_ACCESS_KEY=$RGW_SECRET_KEY
AWS_DEFAULT_REGION=${AWS_DEFAULT_REGION:-us-east-1}
RGW_BUCKET=${RGW_BUCKET:-soak}
export S3_ENDPOINT_URL AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_DEFAULT_REGION RGW_BUCKET
"$PYTHON" -c 'import os, boto3; boto3.client("s3", endpoint_url=os.environ["S3_ENDPOINT_URL"]).create_bucket(Bucket=os.environ["RGW_BUCKET"])'
echo "with-rgw: $S3_ENDPOINT_URL, bucket $RGW_BUCKET (state $STATE_DIR)" >&2
"$@"
