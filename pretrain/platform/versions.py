"""Code and framework versions recorded in every checkpoint manifest, with the container image.

``image_digest`` is the ``IMAGE_DIGEST`` variable the deployments set (Kubernetes through the
``pretrain-env`` ConfigMap, Slurm in ``slurm/pretrain.sbatch``) to the digest of the image they run
(``sha256:...``); outside a container, or where it is not set, it is ``unknown``. ``tiering ls``
shows it per step.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import torch


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not-installed"


@functools.cache
def code_version() -> dict[str, str]:
    """Package version and git commit (``RP_GIT_COMMIT`` wins, for images built without .git)."""
    commit = os.environ.get("RP_GIT_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                timeout=5,
                check=True,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            commit = "unknown"
    return {"package": "resilient-pretrain", "version": _version("resilient-pretrain"), "git_commit": commit}


def image_digest() -> str:
    return os.environ.get("IMAGE_DIGEST", "").strip() or "unknown"


@functools.cache
def framework_versions() -> dict[str, str]:
    return {
        "python": platform.python_version(),
        "torch": _version("torch"),
        "cuda": torch.version.cuda or "none",
        "megatron-core": _version("megatron-core"),
        "nvidia-resiliency-ext": _version("nvidia-resiliency-ext"),
        "transformer-engine": _version("transformer-engine"),
        "image_digest": image_digest(),
    }
