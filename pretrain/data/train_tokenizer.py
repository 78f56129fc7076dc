"""``pretrain train-tokenizer``: a byte-level BPE ``tokenizer.json`` trained offline on local files.

Contract: :func:`train_bpe_tokenizer` trains with the ``tokenizers`` library (ByteLevel
pre-tokenizer and decoder, ``BpeTrainer`` over the 256-byte alphabet, ``min_frequency``) on the
documents of text and JSONL files (:func:`pretrain.data.sources.read_documents`), and writes a
``tokenizer.json`` that :func:`pretrain.data.tokenizer.load_tokenizer` reads as ``huggingface``.
The special tokens come first (ids 0, 1, ...) and always include an end-of-text token (``<|endoftext|>``
is added when none of :data:`~pretrain.data.tokenizer_files.EOD_TOKENS` is given), which becomes
the end-of-document id. Training is deterministic: the same inputs and options give the same file
bytes. The file is written under a temporary name, then renamed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pretrain.data.sources import read_documents
from pretrain.data.tokenizer_files import EOD_TOKENS, open_codec
from pretrain.errors import ConfigError, DataError

BYTE_ALPHABET = 256


def special_tokens_with_eod(special_tokens: Sequence[str]) -> list[str]:
    """``special_tokens`` in order without repeats; ``<|endoftext|>`` first unless an end-of-text token is there."""
    tokens = list(dict.fromkeys(special_tokens))
    if not any(t in EOD_TOKENS for t in tokens):
        tokens.insert(0, EOD_TOKENS[0])
    return tokens


def train_bpe_tokenizer(
    inputs: Sequence[Path | str],
    vocab_size: int,
    output: Path | str,
    special_tokens: Sequence[str] = (),
    json_key: str = "text",
    min_frequency: int = 2,
    skip_bad_lines: bool = False,
) -> dict[str, Any]:
    """Train a byte-level BPE tokenizer on ``inputs`` and save it to ``output``; return its identity."""
    specials = special_tokens_with_eod(special_tokens)
    if vocab_size < BYTE_ALPHABET + len(specials):
        raise ConfigError(
            f"--vocab-size {vocab_size}: smaller than the {BYTE_ALPHABET}-byte alphabet plus {len(specials)} special "
            f"tokens; fix: use at least {BYTE_ALPHABET + len(specials)} (merges need more)"
        )
    if min_frequency < 1:
        raise ConfigError(f"--min-frequency {min_frequency}: must be >= 1; fix: e.g. 2")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    seen = 0

    def counted() -> Iterator[str]:
        nonlocal seen
        for doc in read_documents(inputs, json_key, skip_bad_lines):
            seen += 1
            yield doc

    tok.train_from_iterator(counted(), trainer=trainer)
    if seen == 0:
        shown = ", ".join(map(str, inputs[:3])) or "<no input>"
        raise DataError(f"{shown}: no documents to train on; fix: give non-empty text or JSONL files")
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    try:
        tok.save(str(tmp))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return open_codec("huggingface", out).identity()
