"""Tier 2: step files between nodes.

``transport`` streams a step's files between ranks over torch.distributed (checked on both
ends, every byte keyed with the run key: :mod:`tiering.trust.run_key`), ``replication`` copies a
published step to peers in other failure domains chosen by ``placement``, and ``restore``
recovers tiers 1-2 (own copy, then a peer's replica). Called by the trainer's per-rank tier;
never imports ``pretrain``.
"""
