#!/usr/bin/env bash
# A cluster of network namespaces on this machine running `pretrain launch` on every node (root).
#   sudo scripts/cluster.sh up --workdir /tmp/cl --nodes 3      then type: down 1 / up 1 / replace 2 / quit
#   sudo scripts/cluster.sh clean                               remove what a crashed cluster left
# See tests/cluster/__main__.py and the README ("A cluster on one machine").
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
cd "$here" && PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore exec "$py" -m tests.cluster "$@"
