#!/usr/bin/env bash
# Stop what start.sh started (munged is shared by the machine and left running).
STATE=${STATE:?set STATE}
for pidfile in "$STATE/slurmd.pid" "$STATE/slurmctld.pid"; do
  if [ -f "$pidfile" ]; then
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null
  fi
done
exit 0
