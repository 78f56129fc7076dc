#!/bin/bash
# Slurm Prolog on every compute node: the job's firewall (slurm/job-firewall.sh apply), an nftables
# table rp_job_$SLURM_JOB_ID that lets only the job's nodes reach its rendezvous, store, gloo
# (replication, tier-0 peer) and metrics ports; slurm/epilog.sh deletes it. A failure exits 1
# (Slurm drains the node and requeues the job): the job never runs with its ports open.
#   slurm.conf: Prolog=/path/to/slurm/prolog.sh
#               PrologFlags=Alloc   (run at allocation, before the batch script, on every node)
#               Epilog=/path/to/slurm/epilog.sh
#   settings: /etc/slurm/job-firewall.conf (docs/clusters.md#job-network)
exec "$(dirname "$(readlink -f "$0")")/job-firewall.sh" apply
