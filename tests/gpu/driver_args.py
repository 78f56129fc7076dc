"""The command line of every check driver in ``tests/gpu`` (``--mode cuda|cpu --workdir D --out F``)."""

from __future__ import annotations

import argparse


def parse_driver_args(doc: str | None, argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0] if doc else None)
    parser.add_argument("--mode", choices=["cuda", "cpu"], required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)
