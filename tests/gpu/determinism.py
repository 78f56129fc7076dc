"""The environment the GPU check's training runs need to be deterministic on a GPU (issue 45 #19).

:func:`apply` sets it in ``environ`` before torch initialises cuBLAS and before Transformer Engine
is imported (``tests/gpu/train_driver.py`` calls it first thing): cuBLAS's deterministic workspace,
and TE's switch off of its nondeterministic fused-attention backward, whose kernels raise no torch
warning (the check's tolerance rule could not name them). Forced, not defaulted: a launcher's
``NVTE_ALLOW_NONDETERMINISTIC_ALGO=1`` would turn the check's bit-for-bit comparison into a false
failure. ``docs/fault-tolerance.md`` (Determinism) names the same values; a test keeps them equal.
No torch import here.
"""

from __future__ import annotations

from collections.abc import MutableMapping

DETERMINISTIC_ENV = {
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
}


def apply(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Set :data:`DETERMINISTIC_ENV` in ``environ``; returns what it now holds for those keys."""
    environ.update(DETERMINISTIC_ENV)
    return {k: environ[k] for k in DETERMINISTIC_ENV}
