"""Tiered, verified, atomically published training checkpoints.

Tier 1 is node-local storage (:mod:`tiering.local`). Every tier shares the same publish protocol
(:mod:`tiering.publish`), manifest format (:mod:`tiering.manifest`) and verification
(:mod:`tiering.verify`), so further tiers plug in beside it through :class:`tiering.tier.Tier`.
"""

__version__ = "0.1.0"
