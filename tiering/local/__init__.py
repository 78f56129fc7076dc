"""A tier in a directory: the publish protocol (``publish``: temporary directory, manifest, fsync,
one atomic rename, ``COMMITTED``), :class:`PosixTier` (``posix``: list, verify, quarantine, pin,
retention), step pins (``pins``) and the restore rule (``restore``: newest verified step first,
failures quarantined). Used for the local, replica and staging tiers; never imports ``pretrain``.
"""
