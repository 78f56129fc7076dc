"""A tier in a directory: :class:`PosixTier` (``posix``: list, verify, quarantine, pin, retention)
and the restore rule (``restore``: newest verified step first, failures quarantined).
Used for the local, replica and staging tiers; never imports ``pretrain``.
"""
