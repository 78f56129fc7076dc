#!/usr/bin/env bash
# System packages the test suite runs for real: the Ceph RADOS Gateway (S3) and its daemons.
# Idempotent and quick when they are present; needs root and Debian's apt (as on CI).
set -euo pipefail
need=()
for pair in radosgw:radosgw ceph-mon:ceph-mon ceph-osd:ceph-osd curl:curl; do
  command -v "${pair%%:*}" >/dev/null || need+=("${pair##*:}")
done
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "install-system-deps: missing ${need[*]}; install them (Debian: apt-get install ${need[*]}) or the S3 tests skip" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
