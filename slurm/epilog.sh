#!/bin/bash
# Slurm Epilog (or a cron job) on every compute node: remove the node-local checkpoint data of a
# resilient-pretrain job that is over, never that of a job that is requeued or still running.
#
# `pretrain launch` writes $NODE_STATE_DIR/<job id>.json on each node (default
# /dev/shm/resilient-pretrain/.jobs): the run id and its node-local directories (tier 1 under
# LOCAL_NVME, tier 0 under /dev/shm when checkpoint.memory is on). For each marker (or only
# $SLURM_JOB_ID's, as an Epilog), the directories are removed when Slurm reports the job in a final
# state (COMPLETED, CANCELLED, FAILED, TIMEOUT, NODE_FAIL, OUT_OF_MEMORY, DEADLINE, or gone from
# slurmctld) and no other live job of the same run has a marker here. A requeued job is PENDING:
# kept. Its exit status is 0 whatever it found (an epilog that fails drains the node).
# It also deletes the job's firewall table (slurm/job-firewall.sh remove), if the Prolog made one.
#   slurm.conf: Epilog=/path/to/slurm/epilog.sh   (runs as root: the files belong to the job's user)
set -uo pipefail
# The job's firewall (slurm/job-firewall.sh, made by slurm/prolog.sh): exactly this job's table goes.
if [ -n "${SLURM_JOB_ID:-}" ]; then
  "$(dirname "$(readlink -f "$0")")/job-firewall.sh" remove || echo "epilog: job $SLURM_JOB_ID: its firewall table stays; see above"
fi
state_dir=${NODE_STATE_DIR:-/dev/shm/resilient-pretrain/.jobs}
[ -d "$state_dir" ] || exit 0

job_state() { # the job's state, or GONE when slurmctld no longer knows it
  local out
  out=$(scontrol show job -o "$1" 2>/dev/null) || { echo GONE; return; }
  grep -o 'JobState=[A-Z_]*' <<<"$out" | cut -d= -f2
}
is_final() {
  case "$1" in COMPLETED | CANCELLED | FAILED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY | DEADLINE | BOOT_FAIL | GONE) return 0 ;; esac
  return 1
}
field() { python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); v=d[sys.argv[2]]; print("\n".join(v) if isinstance(v, list) else v)' "$1" "$2"; }

markers=("$state_dir"/*.json)
[ -n "${SLURM_JOB_ID:-}" ] && [ "${EPILOG_ALL:-0}" != 1 ] && markers=("$state_dir/$SLURM_JOB_ID.json")
for marker in "${markers[@]}"; do
  [ -f "$marker" ] || continue
  job=$(basename "$marker" .json)
  state=$(job_state "$job")
  if ! is_final "$state"; then
    echo "epilog: job $job is $state: its node-local checkpoints stay"
    continue
  fi
  run=$(field "$marker" run_id)
  busy=
  for other in "$state_dir"/*.json; do
    [ "$other" = "$marker" ] && continue
    [ "$(field "$other" run_id)" = "$run" ] || continue
    is_final "$(job_state "$(basename "$other" .json)")" || busy=$(basename "$other" .json)
  done
  if [ -n "$busy" ]; then
    echo "epilog: job $job is $state, but job $busy of run $run uses this node: kept"
    continue
  fi
  while IFS= read -r dir; do
    [ -n "$dir" ] && [ "$(basename "$dir")" = "$run" ] && rm -rf --one-file-system -- "$dir" && echo "epilog: job $job ($state): removed $dir"
  done < <(field "$marker" dirs)
  rm -f "$marker"
done
exit 0
