"""``tiering`` as a library: every name of its documented API resolves, and importing the package
loads neither torch nor boto3 (a launcher or a CLI that needs one name never pays for them)."""

from __future__ import annotations

import subprocess
import sys

import tiering


def test_every_public_name_resolves_and_is_documented() -> None:
    for name in tiering.__all__:
        assert getattr(tiering, name) is not None, name
        assert name in (tiering.__doc__ or ""), f"{name} is exported but not in the package's documented API"


def test_importing_tiering_loads_neither_torch_nor_boto3() -> None:
    code = "import sys, tiering; tiering.PosixTier; print(sorted(m for m in ('torch', 'boto3') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
