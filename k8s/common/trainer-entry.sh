#!/bin/sh
# The trainer container's entrypoint on Kubernetes (StatefulSet and JobSet), mounted from the
# pretrain-entry ConfigMap. It owns three things `pretrain launch` does not:
#
# 1. The run's private directory on the node's NVMe hostPath: LOCAL_NVME/RUN_ID is created mode
#    0700 by this pod's uid, and refused (exit 3: node-local, run elsewhere) if it is a symlink or
#    owned by another uid, since other runs on the node mount the same hostPath.
# 2. A finished run stays finished: when `pretrain launch` exits 0 (every step trained) without
#    this pod having been asked to stop, DONE in
#    the run directory (RUN_DIR/RUN_ID, the config's run.dir and run.id) records the sha256 of the
#    config. A start under the same config finds it and does not train again: with
#    IDLE_WHEN_DONE=1 (the StatefulSet, whose pods always restart) it idles, otherwise (JobSet)
#    it exits 0. A changed config (more train.steps) has another hash and trains on.
# 3. SIGTERM reaches `pretrain launch` (which execs ft_launcher: the emergency save path); the
#    container exits with its code: 0 finished, 2 run-level stop (config error, stopped run),
#    3 node-local (this node cannot run it).
#
# Called by: the trainer container of k8s/base/statefulset.yaml and k8s/jobset/jobset.yaml.
# Never: decides anything about checkpoints or retries (pretrain launch and ft_launcher do).
# Tested by tests/test_k8s.py (run here with a stand-in `pretrain`).
umask 077

fail_node_local() {
    echo "trainer-entry: $1" >&2
    exit 3
}

: "${LOCAL_NVME:?LOCAL_NVME is not set; fix: set it in the pod spec}"
: "${RUN_ID:?RUN_ID is not set; fix: set it in the pretrain-env ConfigMap}"
: "${RUN_DIR:?RUN_DIR is not set; fix: set it in the pretrain-env ConfigMap to the config's run.dir}"
CONFIG=${CONFIG:-/etc/pretrain/config.yaml}

private="$LOCAL_NVME/$RUN_ID"
[ -L "$private" ] && fail_node_local "$private on node ${NODE_NAME:-?} is a symlink; fix: remove it there (the run's tier 1 is private)"
mkdir -p "$private" || fail_node_local "$private on node ${NODE_NAME:-?}: cannot create it; fix: make $LOCAL_NVME writable by uid $(id -u)"
[ -O "$private" ] || fail_node_local "$private on node ${NODE_NAME:-?} belongs to another uid; fix: remove it there (the run's tier 1 is private)"
chmod 0700 "$private" || fail_node_local "$private on node ${NODE_NAME:-?}: chmod 0700 failed"

done_file="$RUN_DIR/$RUN_ID/DONE"
config_hash=$(sha256sum "$CONFIG" | cut -d' ' -f1) || exit 2
finished() {
    echo "trainer-entry: run $RUN_ID finished under this config ($done_file); delete it or change the config to train on"
    if [ "${IDLE_WHEN_DONE:-0}" = 1 ]; then
        exec sleep infinity
    fi
    exit 0
}
if [ -f "$done_file" ] && [ "$(cat "$done_file")" = "$config_hash" ]; then
    finished
fi

pretrain launch --config "$CONFIG" "$@" &
child=$!
stopping=0  # a stop asked of this pod (drain, preemption, deletion) never marks the run finished
trap 'stopping=1; kill -TERM "$child" 2>/dev/null' TERM INT
status=0
wait "$child" || status=$?
while kill -0 "$child" 2>/dev/null; do  # the trap interrupted wait: wait for the launcher itself
    status=0
    wait "$child" || status=$?
done
if [ "$status" -eq 0 ] && [ "$stopping" = 0 ]; then
    mkdir -p "$RUN_DIR/$RUN_ID" && printf '%s\n' "$config_hash" > "$done_file.tmp" && mv "$done_file.tmp" "$done_file"
    finished
fi
exit "$status"
