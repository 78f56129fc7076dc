"""Megatron's dataset index cache checked before Megatron opens it: Megatron loads those files with
``numpy.load(..., allow_pickle=True)`` (``gpt_dataset.py``, ``blended_dataset.py``), and numpy
unpickles a file without the ``.npy`` magic, or an object array, so a planted cache file would run
code on every rank at dataset build.

Owns :func:`check_index_cache`: every ``*.npy`` under the cache directory must start with the
``.npy`` magic and declare a dtype without Python objects (read with ``numpy.lib.format``, which
parses the header as a literal and never unpickles); anything else stops the start with one line
(DataError) naming the file and the fix. Never: deletes, rewrites or loads a cache file (Megatron
builds and reads them). Called by :mod:`pretrain.data.dataset` before the dataset builder.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from numpy.lib import format as npy_format

from pretrain.errors import DataError


def cache_dirs(cache_dir: str | None, prefix: str) -> list[Path]:
    """Where Megatron keeps (or will keep) the index files of ``prefix``: ``data.cache_dir``, or
    its default beside the data (``<prefix>/cache``)."""
    return [Path(cache_dir)] if cache_dir else [Path(prefix) / "cache"]


def check_index_cache(directory: Path) -> None:
    """Raise DataError for the first ``*.npy`` under ``directory`` that numpy would unpickle."""
    if not directory.is_dir():
        return
    for path in sorted(directory.rglob("*.npy")):
        try:
            with open(path, "rb") as fh:
                major, _ = npy_format.read_magic(fh)
                read_header = npy_format.read_array_header_1_0 if major == 1 else npy_format.read_array_header_2_0
                _, _, dtype = read_header(fh)
        except (ValueError, OSError, SyntaxError) as exc:
            raise DataError(
                f"{path}: not a numpy array file ({exc}); fix: delete it (the cache is rebuilt) and let only the "
                "prepare-data job write the cache directory"
            ) from exc
        if np.dtype(dtype).hasobject:
            raise DataError(
                f"{path}: an index file holding Python objects (it would be unpickled); fix: delete it (the cache "
                "is rebuilt) and let only the prepare-data job write the cache directory"
            )
