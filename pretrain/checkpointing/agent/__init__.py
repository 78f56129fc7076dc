"""The per-node checkpoint agent: everything after a rank's snapshot, outside the rank.

A rank's only checkpoint work is its tier-0 snapshot (a copy into a slot file in tmpfs, sealed with
its chunk digests). The agent, one process per run per node, turns the sealed slots that tier 1
is due for into published tier-1 steps, verifies the copy against the seal, and applies tier 1's
retention, so that no ``open``, ``fsync``, ``rename`` or ``unlink`` on the tier-1 volume runs in a
training process after its restore, and a stalled volume holds the agent's worker, never a rank.

* :mod:`.drain`: a sealed slot into tier 1, checked, and the retention after it (no process, no socket);
* :mod:`.server`: the agent process (socket loop, worker, status file, lifetime);
* :mod:`.client`: a rank's link to it (find or start, bounded requests).

The rank side, :class:`pretrain.checkpointing.agent_tier.AgentTier`, is tier 1 to the checkpoint
manager when ``checkpoint.agent.enabled`` and tier 0 is on.
"""
