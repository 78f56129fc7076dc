"""Tiered, verified, atomically published training checkpoints.

File-system tiers (node-local, peer replicas, shared staging) are :mod:`tiering.posix`; the object
store is :mod:`tiering.remote`. Every tier shares the same publish protocol
(:mod:`tiering.publish`), manifest format (:mod:`tiering.manifest`) and verification
(:mod:`tiering.verify`), so further tiers plug in beside it through :class:`tiering.tier.Tier`.
"""

__version__ = "0.1.0"
