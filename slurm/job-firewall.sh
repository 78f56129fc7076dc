#!/bin/bash
# The job's network is the job's on Slurm (security review F1; the Kubernetes NetworkPolicy's
# equivalent): an nftables table per job on every node of the job, made by the Prolog and deleted
# by the Epilog, that lets only the job's own nodes (and loopback, and the addresses in ALLOW)
# open a TCP connection to the ports the job listens on:
#   * JOB_PORTS (default 29400-29599): the rendezvous store (RDZV_PORT, 29500 by default), the
#     launcher's and the trainer's fixed stores (MASTER_PORT 29555, evaluation 29561, +2/+3),
#     inprocess.store_port when set (keep it inside);
#   * METRICS_PORTS (default 9400-9401): the trainer's and the uploader's Prometheus ports;
#   * the node's ephemeral range (net.ipv4.ip_local_port_range, read when the table is made): the
#     gloo connections of the process groups, tier-1 replication, tier-0 peer slots and any store
#     that picked a free port all listen there. EPHEMERAL=0 leaves that range open (a shared
#     node, where another job's ephemeral ports must stay reachable from its own nodes).
# Everything else (sshd, slurmd, NFS/Lustre, the job's outgoing connections and their replies) is
# untouched: only a connection's first packet (SYN without ACK) to those ports is judged, and a
# source outside the job is dropped (counted: `nft list table inet rp_job_<id>`).
#
#   job-firewall.sh apply    make (or remake, atomically) table inet rp_job_$SLURM_JOB_ID
#   job-firewall.sh remove   delete exactly that table (none: nothing to do)
#   job-firewall.sh print    print the ruleset `apply` would load, load nothing
#
# Inputs: SLURM_JOB_ID (digits), SLURM_JOB_NODELIST (expanded by `scontrol show hostnames`), each
# node name resolved with `getent ahosts` (IPv4 and IPv6), or JOB_NODE_ADDRESSES (space-separated
# addresses/CIDRs) where the names do not resolve to the addresses the job's traffic uses. Site
# settings come from JOB_FIREWALL_CONF (default /etc/slurm/job-firewall.conf, shell KEY=VALUE
# lines; Slurm starts a Prolog with a bare environment): JOB_PORTS, METRICS_PORTS, EPHEMERAL,
# ALLOW (addresses/CIDRs also let in: the Prometheus hosts, and the slurmctld hosts when srun's
# ports are not kept out of the range with SrunPortRange). The controllers named by SlurmctldHost
# in $SLURM_CONF (default /etc/slurm/slurm.conf), when readable, are always let in: slurmctld
# talks to srun on an ephemeral port. Exits 1 with one line when it cannot do its job (Slurm then
# drains the node and requeues the job: a job never runs with its ports open by accident).
set -euo pipefail
shopt -s inherit_errexit # a die() inside $(...) ends the script, not only the substitution
conf=${JOB_FIREWALL_CONF:-/etc/slurm/job-firewall.conf}
# shellcheck disable=SC1090 # the site's settings
[ -r "$conf" ] && . "$conf"
JOB_PORTS=${JOB_PORTS:-29400-29599}
METRICS_PORTS=${METRICS_PORTS:-9400-9401}
EPHEMERAL=${EPHEMERAL:-1}
ALLOW=${ALLOW:-}

die() {
  echo "job-firewall: $*" >&2
  exit 1
}

job=${SLURM_JOB_ID:-}
[[ "$job" =~ ^[0-9]+$ ]] || die "SLURM_JOB_ID='$job' is not a job id; fix: run as a Slurm Prolog/Epilog (it sets SLURM_JOB_ID)"
table="rp_job_$job"

# The job's nodes' addresses, one a line: JOB_NODE_ADDRESSES, or each node name resolved.
node_addresses() {
  local name addrs
  if [ -n "${JOB_NODE_ADDRESSES:-}" ]; then
    tr ' ' '\n' <<<"$JOB_NODE_ADDRESSES" | sed '/^$/d'
    return
  fi
  [ -n "${SLURM_JOB_NODELIST:-}" ] || die "SLURM_JOB_NODELIST is empty; fix: run as a Slurm Prolog with PrologFlags=Alloc, or set JOB_NODE_ADDRESSES"
  local names
  names=$(scontrol show hostnames "$SLURM_JOB_NODELIST") || die "scontrol show hostnames '$SLURM_JOB_NODELIST' failed; fix: check SLURM_CONF on this node"
  for name in $names; do
    addrs=$(getent ahosts "$name" | awk '{print $1}' | sort -u) || true
    [ -n "$addrs" ] || die "node $name of job $job does not resolve; fix: add it to DNS or /etc/hosts, or set JOB_NODE_ADDRESSES"
    echo "$addrs"
  done
}

# The slurmctld hosts of slurm.conf (SlurmctldHost=name or name(address); ControlMachine/ControlAddr).
controller_addresses() {
  local file=${SLURM_CONF:-/etc/slurm/slurm.conf} host
  [ -r "$file" ] || return 0
  for host in $(sed -n -E 's/^[[:space:]]*(SlurmctldHost|ControlMachine|ControlAddr|BackupController|BackupAddr)[[:space:]]*=[[:space:]]*([^[:space:]#]+).*/\2/Ip' "$file"); do
    if [[ "$host" =~ \((.+)\) ]]; then host=${BASH_REMATCH[1]}; fi
    getent ahosts "$host" | awk '{print $1}' | sort -u || true
  done
}

# A set's elements from addresses/CIDRs, one a line: those of the family ($1: 4 or 6), comma-joined.
elements() {
  if [ "$1" = 4 ]; then grep -v ':' || true; else grep ':' || true; fi | sort -u | paste -sd, -
}

ruleset() {
  local addrs v4 v6 ports lo hi
  addrs=$(
    node_addresses
    controller_addresses
    tr ' ,' '\n\n' <<<"$ALLOW" | sed '/^$/d'
  )
  v4=$(elements 4 <<<"$addrs")
  v6=$(elements 6 <<<"$addrs")
  [ -n "$v4" ] && v4="elements = { $v4 }"
  [ -n "$v6" ] && v6="elements = { $v6 }"
  ports="${JOB_PORTS// /, }, ${METRICS_PORTS// /, }"
  if [ "$EPHEMERAL" = 1 ]; then
    read -r lo hi </proc/sys/net/ipv4/ip_local_port_range
    ports="$ports, $lo-$hi"
  fi
  # The table is declared, deleted and made again in one transaction: a re-run (a requeued job's
  # Prolog on the same node) replaces it, and no moment leaves the ports open.
  cat <<EOF
table inet $table {}
delete table inet $table
table inet $table {
	comment "resilient-pretrain job $job: its ports accept only its nodes (slurm/job-firewall.sh)"
	set ports {
		type inet_service; flags interval; auto-merge
		elements = { $ports }
	}
	set nodes4 {
		type ipv4_addr; flags interval; auto-merge
		$v4
	}
	set nodes6 {
		type ipv6_addr; flags interval; auto-merge
		$v6
	}
	chain input {
		type filter hook input priority filter - 10; policy accept;
		iif "lo" accept
		meta l4proto != tcp accept
		tcp flags & (syn | ack) != syn accept
		tcp dport != @ports accept
		ip saddr @nodes4 accept
		ip6 saddr @nodes6 accept
		counter drop comment "a connection to the job's ports from outside the job"
	}
}
EOF
}

case "${1:-}" in
  print) ruleset ;;
  apply)
    command -v nft >/dev/null || die "nft not found; fix: apt-get install nftables (or dnf install nftables) on every compute node"
    rules=$(ruleset)
    nft -f - <<<"$rules" || die "nft could not load table inet $table; fix: check the kernel's nf_tables (modprobe nf_tables) and the settings in $conf"
    echo "job-firewall: job $job: table inet $table loaded"
    ;;
  remove)
    command -v nft >/dev/null || exit 0 # no nftables on this node: no table of this job either
    if nft list table inet "$table" >/dev/null 2>&1; then
      nft delete table inet "$table" || die "nft could not delete table inet $table"
      echo "job-firewall: job $job: table inet $table deleted"
    fi
    ;;
  *) die "usage: job-firewall.sh apply|remove|print (got '${1:-}')" ;;
esac
