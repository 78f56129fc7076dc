#!/usr/bin/env bash
# Stop what start.sh started: slurmd, slurmctld, and munged when start.sh started it (a munged that
# was already running belongs to the machine and is left alone).
STATE=${STATE:?set STATE}
pidfiles=("$STATE/slurmd.pid" "$STATE/slurmctld.pid")
[ -f "$STATE/munged.started" ] && pidfiles+=(/run/munge/munged.pid)
for pidfile in "${pidfiles[@]}"; do
  if [ -f "$pidfile" ]; then
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null
  fi
done
# proctrack/cgroup leaves its node's empty freezer groups behind (best effort: only empty ones go).
rmdir /sys/fs/cgroup/freezer/slurm_localhost/uid_*/job_*/step_* /sys/fs/cgroup/freezer/slurm_localhost/uid_*/job_* \
  /sys/fs/cgroup/freezer/slurm_localhost/uid_* /sys/fs/cgroup/freezer/slurm_localhost 2>/dev/null
exit 0
