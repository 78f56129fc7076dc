"""The run's secret and what it authenticates.

``run_key`` is the per-run secret (a private key file, HMAC-SHA256 tags per channel) and the
contract of every channel keyed with it: the step transport between ranks, tier 0's peer slots
and the signed manifests. ``signature`` is one such channel: the ``SIGNATURE`` beside the manifest
of a staging (reshardable) or S3 step. Pure standard library; never imports ``pretrain``.
"""
