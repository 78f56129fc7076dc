"""``pretrain prepare-data`` throughput against the raw ``tokenizers`` batch encode of the same text.

Run: ``python -m bench.prepare_numbers [MB]`` (after ``make venv``). The corpus is the Python
standard library's sources (JSONL, one document per file) repeated to ``MB`` megabytes; the
tokenizer is a 1,024-token BPE trained on it. The baselines are what any preparation must at least
do, with the text already in memory: ``Tokenizer.encode_batch`` over every document in one process
(the library's own threads), and the same split over two processes (each encoding its half,
single-threaded: the parallelism ``--workers 2`` has, the fair limit for the ratio). The
measured path is the real command, ``pretrain prepare-data --workers 2`` in its
own process: read the JSONL, tokenize in 2 worker processes, append end-of-document, write
``.bin``/``.idx``. Its fixed start-up (interpreter, torch/Megatron imports, worker spawn) is
measured on a one-document input and reported apart, so that the rate is the one a large corpus
sees. Both alternate, 3 times each; medians and spreads are printed as JSON. A ratio above 1 would
mean the baseline does not measure the limit.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.pool
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tokenizers import Tokenizer

from pretrain.commands.demo_data import stdlib_sources
from pretrain.data.train_tokenizer import train_bpe_tokenizer


def _corpus(work: Path, mb: float) -> tuple[Path, list[str], int]:
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in stdlib_sources(8.0)]
    docs, size = [], 0
    while size < mb * 1e6:
        for text in texts:
            docs.append(text)
            size += len(text.encode())
    path = work / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path, docs, size


def _prepare(jsonl: Path, tokenizer: Path, out: Path) -> float:
    cmd = [sys.executable, "-m", "pretrain", "prepare-data", "--input", str(jsonl), "--output", str(out)]
    cmd += ["--tokenizer", "huggingface", "--tokenizer-path", str(tokenizer), "--workers", "2", "--no-progress"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return time.perf_counter() - t0


_docs: list[str] = []
_tok: Tokenizer | None = None


def _load(jsonl: str, tokenizer: str) -> None:
    global _docs, _tok
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _docs = [json.loads(line)["text"] for line in Path(jsonl).read_text(encoding="utf-8").splitlines()]
    _tok = Tokenizer.from_file(tokenizer)


def _encode_part(part: tuple[int, int]) -> int:
    assert _tok is not None
    return sum(len(e.ids) for e in _tok.encode_batch(_docs[part[0] :: part[1]]))


def _raw_two_processes(pool: multiprocessing.pool.Pool, size: int) -> float:
    t0 = time.perf_counter()
    pool.map(_encode_part, [(0, 2), (1, 2)])
    return size / (time.perf_counter() - t0) / 1e6


def main(mb: float = 48.0, repeats: int = 3) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix="rp-prepare-bench-"))
    jsonl, docs, size = _corpus(work, mb)
    tok_path = work / "tokenizer.json"
    train_bpe_tokenizer([jsonl], 1024, tok_path)
    tiny = work / "tiny.jsonl"
    tiny.write_text(json.dumps({"text": docs[0][:1000]}) + "\n")
    tok = Tokenizer.from_file(str(tok_path))
    raw, raw2, ours, startup = [], [], [], []
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2, initializer=_load, initargs=(str(jsonl), str(tok_path))) as pool:
        pool.map(_encode_part, [(0, 1000), (1, 1000)])  # workers up and warm before timing
        for i in range(repeats):
            t0 = time.perf_counter()
            tok.encode_batch(docs)
            raw.append(size / (time.perf_counter() - t0) / 1e6)
            raw2.append(_raw_two_processes(pool, size))
            startup.append(_prepare(tiny, tok_path, work / f"tiny{i}"))
            ours.append(size / max(_prepare(jsonl, tok_path, work / f"out{i}") - startup[-1], 1e-9) / 1e6)
    ratio = statistics.median(ours) / statistics.median(raw2)
    out = {
        "corpus_mb": round(size / 1e6, 1),
        "raw_encode_batch_one_process_mb_s": [round(x, 2) for x in raw],
        "raw_encode_batch_two_processes_mb_s": [round(x, 2) for x in raw2],
        "prepare_data_2_workers_mb_s_after_startup": [round(x, 2) for x in ours],
        "prepare_data_startup_s": [round(x, 2) for x in startup],
        "ratio_of_medians_vs_two_processes": round(ratio, 3),
        "target": ">= 0.8",
        # The raw baseline's own run-to-run spread on this VM is about +-15 %: only a clear excess is a flag.
        "flag": "ratio above 1 by more than noise: the baseline is not the limit" if ratio > 1.15 else None,
    }
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 48.0)
