"""Peak RSS of ``--dedup``'s gates on a generated corpus: the digest set on disk (pretrain.data.gates)
against the in-memory ``set`` it replaced, in separate processes.

    python bench/dedup_memory.py --gb 1 --doc-bytes 200 --mode disk|set

Documents are generated (seeded, ``--dup`` of them repeats of earlier ones), never stored: what is
measured is the gates' memory per distinct document, which is what grows with a corpus.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from pretrain.data.gates import DocumentGates, text_digest


def documents(total_bytes: int, doc_bytes: int, dup: float, seed: int) -> Iterator[str]:
    rng = random.Random(seed)
    filler = "x" * doc_bytes
    made = emitted = 0
    while emitted < total_bytes:
        i = rng.randrange(made) if made and rng.random() < dup else made
        made += i == made
        doc = f"document {i} {filler}"[:doc_bytes]
        emitted += len(doc)
        yield doc


def in_memory_set(docs: Iterator[str]) -> int:
    """The replaced gates: a Python set of digests plus the kept digests in a bytearray."""
    seen: set[bytes] = set()
    kept = bytearray()
    for doc in docs:
        digest = text_digest(doc)
        if digest not in seen:
            seen.add(digest)
            kept += digest
    return len(kept) // 16


def on_disk(docs: Iterator[str], where: Path) -> int:
    gates = DocumentGates(dedup=True, spill_dir=where)
    kept = sum(1 for _ in gates.filter(docs))
    gates.save_kept_digests(where / "kept.digests")
    return kept


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--doc-bytes", type=int, default=200)
    ap.add_argument("--dup", type=float, default=0.2)
    ap.add_argument("--mode", choices=["disk", "set"], required=True)
    args = ap.parse_args()
    docs = documents(int(args.gb * 1e9), args.doc_bytes, args.dup, 0)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        kept = on_disk(docs, Path(tmp)) if args.mode == "disk" else in_memory_set(docs)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps(
            {
                "mode": args.mode,
                "gb": args.gb,
                "kept": kept,
                "peak_rss_mb": round(rss_mb, 1),
                "seconds": round(time.perf_counter() - started, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
