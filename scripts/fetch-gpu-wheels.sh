#!/usr/bin/env bash
# Fetch the wheels the GPU machine lacks (cp312, manylinux x86_64) into wheels/ (git-ignored), for
# scripts/gpu-check.sh to install offline. Prints each wheel's size and the total, and fails if
# the total exceeds the 64 MiB a device run may carry.
#
#   scripts/fetch-gpu-wheels.sh [DEST]        (default DEST: wheels)
#
# What is fetched, and why:
# * megatron-core and nvidia-resiliency-ext, the newest releases of the lines the Dockerfile pins
#   (megatron-core 0.19.x, NVRx 0.7.x: what the users' containers run and compat.py supports).
#   NVRx >= 0.5 ships manylinux_2_39 wheels only (glibc 2.39, e.g. Ubuntu 24.04); 0.4.1
#   (manylinux_2_31) is fetched too, and pip on the GPU machine installs the newest that fits.
# * What NVRx 0.7's ft_launcher and rank-monitor client import at module level (read from the
#   0.7.0 sources): defusedxml, protobuf, grpcio, httpx (+ httpcore, h11, anyio, sniffio, idna,
#   certifi), typing-extensions; nvidia-ml-py (pynvml, imported lazily); packaging (megatron-core).
# * What the project imports that the GPU machine lacks: blake3 and xxhash (tiering's chunked
#   digests), tqdm (prepare-data). Optional format readers (zstandard for .zst input, pyarrow for
#   Parquet) are imported only where a file needs them, so the check does not carry them
#   (tests/test_optional_imports.py imports the rank program without them).
# * What the check itself needs beyond torch: pytest (+ pluggy, iniconfig,
#   pygments) and pytest-timeout.
# Transformer Engine is not fetched: its CUDA wheels are far over 64 MiB (the check then runs
# Megatron's local spec on CUDA and says so in its report).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-wheels}
PYTHON=${PYTHON:-.venv/bin/python}
LIMIT_MIB=64
mkdir -p "$DEST"
PLATFORM=(--platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux_2_31_x86_64
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
  --platform any)
download() {
  # The machine's pip constraints (a cap on torch) have nothing to say about cp312 wheels for another host.
  PIP_CONSTRAINT="" "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none "${PLATFORM[@]}" -d "$DEST" "$@"
}
download "megatron-core>=0.19,<0.20" "nvidia-resiliency-ext>=0.7,<0.8"
download "nvidia-resiliency-ext==0.4.1"
download defusedxml protobuf grpcio httpx httpcore h11 anyio sniffio idna certifi typing-extensions \
  nvidia-ml-py "packaging>=24.2" blake3 xxhash tqdm pytest pluggy iniconfig pygments pytest-timeout
total=0
printf '%-80s %8s\n' WHEEL KiB
for whl in "$DEST"/*.whl; do
  size=$(stat -c %s "$whl")
  total=$((total + size))
  printf '%-80s %8d\n' "$(basename "$whl")" $((size / 1024))
done
printf 'total: %d bytes (%.1f MiB; limit %d MiB)\n' "$total" "$(echo "$total / 1048576" | bc -l)" "$LIMIT_MIB"
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "fetch-gpu-wheels: $DEST holds more than $LIMIT_MIB MiB; fix: remove old wheels (rm -r $DEST) and fetch again" >&2
  exit 1
fi
