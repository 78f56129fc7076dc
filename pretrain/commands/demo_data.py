"""The demo's workload: real text that ships with every machine, a tokenizer trained on it.

The corpus is the Python standard library's own source files (``sysconfig``'s ``stdlib`` path,
test directories left out), one document per file, written as JSONL; a byte-level BPE tokenizer
is trained on it in seconds and the files are tokenized into a Megatron indexed dataset with the
project's own ``pretrain train-tokenizer`` and ``pretrain prepare-data``. The unigram entropy of the
resulting tokens is the yardstick the validation loss must end below (a model that learnt nothing
beyond token frequencies scores exactly that).
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset

SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__", "lib2to3"}


def stdlib_sources(limit_mb: float) -> list[Path]:
    """The standard library's ``.py`` files outside tests, in a fixed order, up to ``limit_mb``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if SKIP_DIRS & set(path.relative_to(root).parts[:-1]):
            continue
        size = path.stat().st_size
        if total + size > limit_mb * 1024 * 1024:
            break
        out.append(path)
        total += size
    return out


def write_jsonl(paths: list[Path], output: Path) -> int:
    """One ``{"text": ...}`` line per file; returns the bytes of text written."""
    output.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with open(output, "w", encoding="utf-8") as out:
        for path in paths:
            text = path.read_text(encoding="utf-8", errors="replace")
            out.write(json.dumps({"text": text}) + "\n")
            written += len(text.encode())
    return written


def prepare(work: Path, limit_mb: float, vocab_size: int) -> tuple[Path, Path]:
    """Corpus, tokenizer and dataset under ``work/data``; returns (tokenizer.json, dataset prefix)."""
    data = work / "data"
    jsonl = data / "stdlib.jsonl"
    mb = write_jsonl(stdlib_sources(limit_mb), jsonl) / 1e6
    tokenizer, prefix = data / "tokenizer.json", data / "stdlib"
    print(f"[demo] corpus: {mb:.1f} MB of Python standard library sources ({jsonl})", flush=True)
    run = [sys.executable, "-m", "pretrain"]
    subprocess.run(
        [*run, "train-tokenizer", "--input", str(jsonl), "--vocab-size", str(vocab_size), "--output", str(tokenizer)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    tok = ["--tokenizer", "huggingface", "--tokenizer-path", str(tokenizer)]
    subprocess.run(
        [*run, "prepare-data", "--input", str(jsonl), *tok, "--output", str(prefix), "--workers", "2", "--no-progress"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    print(f"[demo] BPE tokenizer ({vocab_size} tokens) trained: {tokenizer}; dataset: {prefix}.bin/.idx", flush=True)
    return tokenizer, prefix


def unigram_entropy(prefix: Path) -> float:
    """Entropy in nats of the token distribution of the dataset (every document, end-of-document included)."""
    ids = np.memmap(f"{prefix}.bin", dtype=IndexedDataset(str(prefix)).index.dtype, mode="r")
    counts = np.bincount(np.asarray(ids, dtype=np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
