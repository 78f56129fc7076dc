#!/usr/bin/env bash
# Start a throwaway single-node Ceph with the RADOS Gateway (a real S3 server) on 127.0.0.1.
#   STATE_DIR=/tmp/x RGW_PORT=7480 scripts/ceph/start-rgw.sh
# Prints "endpoint=http://127.0.0.1:PORT" when ready. Keys: testing/testing. Stop: scripts/ceph/stop-rgw.sh.
set -euo pipefail
: "${STATE_DIR:?set STATE_DIR to an empty scratch directory}"
RGW_PORT=${RGW_PORT:-7480}
MON_PORT=${MON_PORT:-6789}
MEMSTORE_BYTES=${MEMSTORE_BYTES:-6442450944}
here=$(cd "$(dirname "$0")" && pwd)
for bin in ceph-mon ceph-osd radosgw radosgw-admin ceph ceph-authtool monmaptool curl; do
  command -v "$bin" >/dev/null || { echo "start-rgw: $bin not found; fix: scripts/install-system-deps.sh" >&2; exit 2; }
done
rm -rf "$STATE_DIR" && mkdir -p "$STATE_DIR"/{run,log,mon,osd/osd.0,rgw}
CONF=$STATE_DIR/ceph.conf
sed -e "s#@STATE_DIR@#$STATE_DIR#g" -e "s#@RGW_PORT@#$RGW_PORT#g" -e "s#@MON_PORT@#$MON_PORT#g" \
    -e "s#@MEMSTORE_BYTES@#$MEMSTORE_BYTES#g" "$here/ceph.conf.in" > "$CONF"
cd "$STATE_DIR"
FSID=$(awk '/^fsid/ {print $3}' "$CONF")
ceph-authtool --create-keyring keyring --gen-key -n mon. --cap mon 'allow *' >/dev/null
ceph-authtool keyring --gen-key -n client.admin --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' >/dev/null
monmaptool --create --fsid "$FSID" --addv a "[v1:127.0.0.1:$MON_PORT]" monmap >/dev/null
ceph-mon -c "$CONF" --mkfs -i a --monmap monmap --keyring keyring
ceph-mon -c "$CONF" -i a
deadline=$((SECONDS + 60))
until timeout 5 ceph -c "$CONF" mon stat >/dev/null 2>&1; do
  [ $SECONDS -lt $deadline ] || { echo "start-rgw: monitor did not come up; see $STATE_DIR/log" >&2; exit 1; }
  sleep 0.2
done
# Register the OSD with the same uuid it is created with: otherwise the monitor may refuse its boot
# ("wrong fsid") because osd.0 was registered under another uuid.
OSD_UUID=$(cat /proc/sys/kernel/random/uuid)
OSDID=$(timeout 30 ceph -c "$CONF" osd create "$OSD_UUID")
ceph-osd -c "$CONF" -i "$OSDID" --mkfs --osd-uuid "$OSD_UUID" 2>/dev/null
# Under load the OSD can send its first monitor command before it holds the cluster's fsid: the
# monitor refuses it ("wrong fsid" in osd.0.log), the OSD's init fails and ceph-osd exits non-zero
# (a CI run lost all three of the suite's tries to it). Its store is made: start it again.
for osd_try in 1 2 3 4; do
  ceph-osd -c "$CONF" -i "$OSDID" 2>/dev/null && break
  [ $osd_try -lt 4 ] || { echo "start-rgw: osd.$OSDID failed to start 4 times; see $STATE_DIR/log" >&2; exit 1; }
  echo "start-rgw: osd.$OSDID failed its start ($(tail -n 1 "$STATE_DIR/log/osd.$OSDID.log")); starting it again" >&2
  sleep 1
done
until timeout 10 ceph -c "$CONF" osd stat 2>/dev/null | grep -q "1 up"; do
  [ $SECONDS -lt $deadline ] || { echo "start-rgw: OSD did not come up; see $STATE_DIR/log" >&2; exit 1; }
  sleep 0.5
done
radosgw -c "$CONF" -n client.rgw.a
until curl -sf -o /dev/null "http://127.0.0.1:$RGW_PORT/"; do
  [ $SECONDS -lt $((deadline + 60)) ] || { echo "start-rgw: radosgw did not answer; see $STATE_DIR/log" >&2; exit 1; }
  sleep 0.2
done
radosgw-admin -c "$CONF" user create --uid=testing --display-name=testing --access-key=testing \
  --secret-key="${RGW_SECRET_KEY:-testing}" >/dev/null
echo "endpoint=http://127.0.0.1:$RGW_PORT"
