#!/usr/bin/env bash
# Start a one-node Slurm cluster (slurmctld + slurmd + munge) for the tests, by hand.
# Usage: STATE=/some/dir scripts/slurm/start.sh; then export SLURM_CONF=$STATE/slurm.conf.
# Needs root and Debian's slurmctld slurmd slurm-client munge (scripts/install-system-deps.sh).
set -euo pipefail
STATE=${STATE:?set STATE to a scratch directory}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$STATE"/{ctld,spool,log} /run/munge /etc/munge
cpus=$(nproc)
sed -e "s#@STATE@#$STATE#g" -e "s#@CPUS@#$cpus#g" \
    -e "s#@CTLD_PORT@#${CTLD_PORT:-6817}#g" -e "s#@SLURMD_PORT@#${SLURMD_PORT:-6818}#g" \
    -e "s#@SPARE_PORT@#${SPARE_PORT:-6819}#g" \
    "$here/slurm.conf.in" > "$STATE/slurm.conf"
# gres.conf beside slurm.conf: eight empty files stand in for the GPUs the sbatch asks for.
mkdir -p "$STATE/gpus"
touch "$STATE"/gpus/gpu{0..7}
echo "Name=gpu File=$STATE/gpus/gpu[0-7]" > "$STATE/gres.conf"
# proctrack/cgroup where the machine allows it (a cgroup v1 freezer this root can make groups in,
# what Slurm 22.05's cgroup/v1 plugin needs), as production clusters run: job steps tracked and
# signalled by cgroup; else proctrack/linuxproc (parent-child links). SLURM_PROCTRACK forces one.
if [ -z "${SLURM_PROCTRACK:-}" ]; then
  SLURM_PROCTRACK=linuxproc
  if mkdir "/sys/fs/cgroup/freezer/rp-probe-$$" 2>/dev/null; then
    rmdir "/sys/fs/cgroup/freezer/rp-probe-$$"
    SLURM_PROCTRACK=cgroup
  fi
fi
if [ "$SLURM_PROCTRACK" = cgroup ]; then
  sed -i 's#^ProctrackType=.*#ProctrackType=proctrack/cgroup#' "$STATE/slurm.conf"
  printf 'CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\nCgroupAutomount=no\n' > "$STATE/cgroup.conf"
fi
echo "slurm: proctrack/$SLURM_PROCTRACK"
export SLURM_CONF=$STATE/slurm.conf
# munge authenticates every Slurm RPC; a key is created once per machine.
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown -R munge:munge /etc/munge /run/munge
chmod 0700 /etc/munge; chmod 0400 /etc/munge/munge.key; chmod 0755 /run/munge
if ! { [ -f /run/munge/munged.pid ] && kill -0 "$(cat /run/munge/munged.pid)" 2>/dev/null; }; then
  runuser -u munge -- /usr/sbin/munged
  touch "$STATE/munged.started"  # ours: stop.sh stops it (one already running is left alone)
fi
munge -n | unmunge >/dev/null
/usr/sbin/slurmctld -f "$SLURM_CONF"
/usr/sbin/slurmd -f "$SLURM_CONF" -N localhost
for _ in $(seq 1 300); do
  sinfo -h -N -o '%T' 2>/dev/null | grep -Eq '^(idle|mixed)' && { echo "slurm up: $SLURM_CONF"; exit 0; }
  sleep 0.1
done
echo "slurm did not come up; see $STATE/log/" >&2
exit 1
