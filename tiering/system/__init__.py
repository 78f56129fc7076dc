"""What the operating system gives the tiers: durable file-system primitives (``fsio``), whether
a file's bytes are cached and read-ahead (``page_cache``), and the process's hashing threads,
kept for its life (``hash_threads``), and private per-run directories (``private_dir``). No tier
logic; never imports ``pretrain``.
"""
