"""Tier 0: each rank's state in sealed memory (tmpfs) slots.

``slots`` holds the rotation and sealing rules (pure logic), ``slot_store`` the slot files
(write, seal, verify, list) and ``peer_slots`` the copy of sealed slots on the tier-2 peer.
Called by the trainer's memory tier; never imports ``pretrain``.
"""
