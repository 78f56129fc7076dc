#!/usr/bin/env bash
# System packages the test suite runs for real: the Ceph RADOS Gateway (S3) and its daemons, a
# one-node Slurm (slurmctld, slurmd, munge), Prometheus' promtool and nftables (nft: the Slurm
# Prolog's job firewall, slurm/job-firewall.sh, applied for real on the netns cluster). kubectl
# (for `kubectl kustomize`) comes with our machines' base image; Debian 12's kubernetes-client is too old for
# kustomize components, so it is not installed here.
# Idempotent and quick when they are present; needs root and Debian's apt (as on CI).
set -euo pipefail
need=()
for pair in radosgw:radosgw ceph-mon:ceph-mon ceph-osd:ceph-osd curl:curl \
  slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge promtool:prometheus nft:nftables; do
  command -v "${pair%%:*}" >/dev/null || need+=("${pair##*:}")
done
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "install-system-deps: missing ${need[*]}; install them (Debian: apt-get install ${need[*]}) or the tests that need them skip" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
command -v kubectl >/dev/null || echo "install-system-deps: kubectl not found; the Kubernetes manifest tests need kubectl >= 1.27 (kustomize v5)" >&2
