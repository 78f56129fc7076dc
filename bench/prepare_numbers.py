"""``pretrain prepare-data`` throughput against the raw ``tokenizers`` batch encode of the same text.

Run: ``python -m bench.prepare_numbers [MB]`` (after ``make venv``). The corpus is the Python
standard library's sources (JSONL, one document per file); the tokenizer is a 1,024-token BPE
trained on it. The baseline is what any preparation must at least do: ``Tokenizer.encode_batch``
over every document, in memory, in one process (the library uses every core). The measured path
is the whole command's work: read the JSONL, tokenize in 2 worker processes, append
end-of-document, write ``.bin``/``.idx``. Both alternate, 3 times each; medians and spreads are
printed as JSON. A ratio above 1 would mean the baseline does not measure the limit.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tokenizers import Tokenizer

from pretrain.commands.demo_data import stdlib_sources, write_jsonl
from pretrain.data.prepare import prepare_data
from pretrain.data.train_tokenizer import train_bpe_tokenizer


def main(mb: float = 8.0, repeats: int = 3) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix="rp-prepare-bench-"))
    jsonl = work / "corpus.jsonl"
    size = write_jsonl(stdlib_sources(mb), jsonl)
    tok_path = work / "tokenizer.json"
    train_bpe_tokenizer([jsonl], 1024, tok_path)
    docs = [json.loads(line)["text"] for line in jsonl.read_text().splitlines()]
    tok = Tokenizer.from_file(str(tok_path))
    raw, ours = [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        tok.encode_batch(docs)
        raw.append(size / (time.perf_counter() - t0) / 1e6)
        t0 = time.perf_counter()
        prepare_data(
            work / f"out{i}",
            inputs=[jsonl],
            tokenizer="huggingface",
            tokenizer_path=str(tok_path),
            workers=2,
            progress=False,
        )
        ours.append(size / (time.perf_counter() - t0) / 1e6)
    ratio = statistics.median(ours) / statistics.median(raw)
    out = {
        "corpus_mb": round(size / 1e6, 2),
        "raw_encode_batch_mb_s": {"median": round(statistics.median(raw), 2), "all": [round(x, 2) for x in raw]},
        "prepare_data_2_workers_mb_s": {
            "median": round(statistics.median(ours), 2),
            "all": [round(x, 2) for x in ours],
        },
        "ratio": round(ratio, 3),
        "target": ">= 0.8",
        "flag": "ratio above 1: the baseline is not the limit" if ratio > 1.05 else None,
    }
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 8.0)
