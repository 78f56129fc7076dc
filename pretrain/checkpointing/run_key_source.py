"""Where the rank program gets its run key (:mod:`tiering.trust.run_key`), the secret every transfer
between ranks is tagged with.

Owns the choice of the key file: ``PRETRAIN_RUN_KEY_FILE`` if set, else
``checkpoint.integrity.run_key_file`` if configured (both must already exist: a secret the user
provides is never made up here), else ``<run.dir>/<run.id>/run.key``, which rank 0 creates (mode
0600) when absent, before any other rank reads it (the run directory is shared by every node, as
the attempt records are). Collective: every rank calls :func:`load_run_key` at the same point.

Never: writes a key anywhere but that default file, logs the secret, or starts without a key (a
key file others can read, or one that is missing where it must exist, stops the start with one
line and the fix). Called by :class:`pretrain.checkpointing.tiered.TieredCheckpointer`.
"""

from __future__ import annotations

from pathlib import Path

from pretrain.config import IntegrityConfig, RunConfig
from pretrain.observability.runlog import run_dir
from tiering.collective import Collective
from tiering.errors import RunKeyError
from tiering.trust.run_key import RunKey, key_file_from_env, load, load_or_create

DEFAULT_NAME = "run.key"


def key_path(integrity: IntegrityConfig, run: RunConfig) -> tuple[Path, bool]:
    """The key file and whether this program may create it (only the default one)."""
    named = key_file_from_env() or (Path(integrity.run_key_file) if integrity.run_key_file else None)
    if named is not None:
        return named, False
    return run_dir(run.dir, run.id) / DEFAULT_NAME, True


def load_run_key(integrity: IntegrityConfig, run: RunConfig, coll: Collective) -> RunKey:
    """Rank 0 loads (or creates) the key first; then every other rank loads it. Raises RunKeyError
    (one line) on every rank when rank 0 could not."""
    path, may_create = key_path(integrity, run)
    error: str | None = None
    if coll.rank == 0:
        try:
            load_or_create(path, create=may_create)
        except RunKeyError as exc:
            error = str(exc)
    error = coll.broadcast(error, src=0)
    if error is not None:
        raise RunKeyError(error)
    return load(path)
