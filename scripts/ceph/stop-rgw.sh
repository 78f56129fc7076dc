#!/usr/bin/env bash
# Stop what start-rgw.sh started (by pid files) and remove its state.
set -uo pipefail
: "${STATE_DIR:?set STATE_DIR}"
for pidfile in "$STATE_DIR"/run/*.pid; do
  [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null
done
for _ in $(seq 1 50); do
  alive=0
  for pidfile in "$STATE_DIR"/run/*.pid; do
    [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null && alive=1
  done
  [ $alive = 0 ] && break
  sleep 0.2
done
for pidfile in "$STATE_DIR"/run/*.pid; do
  [ -f "$pidfile" ] && kill -9 "$(cat "$pidfile")" 2>/dev/null
done
rm -rf "$STATE_DIR"
