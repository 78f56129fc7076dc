"""Megatron tokenizers for pretraining: byte-level, Hugging Face ``tokenizer.json``, SentencePiece.

Contract: :func:`load_tokenizer` returns a ``MegatronTokenizerBase`` (what ``GPTDatasetConfig``
takes) with ``vocab_size``, ``eod``, ``tokenize``, ``detokenize`` and ``unique_identifiers``
(Megatron hashes it into the dataset cache key: the class, the file's SHA-256, the vocabulary size
and the end-of-document id, never the path, so a moved copy keeps its cache). :func:`tokenizer_identity`
is what a checkpoint manifest records. Files are read offline by :mod:`pretrain.data.tokenizer_files`.

Megatron's own wrappers are not used: megatron-core 0.16.1's ``HuggingFaceTokenizer`` needs
``transformers``, which this project does not install (the ``tokenizers`` library reads a
``tokenizer.json`` by itself); its ``SentencePieceTokenizer`` works offline but imports torch,
which prepare-data's worker processes avoid, so both kinds use the libraries directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron.core.tokenizers import MegatronTokenizerBase

from pretrain.data.tokenizer_files import ByteCodec, Codec, open_codec


class CodecTokenizer(MegatronTokenizerBase):
    """A Megatron tokenizer over a :class:`Codec`."""

    def __init__(self, codec: Codec) -> None:
        super().__init__(path=str(codec.path or ""), config={})
        self.codec = codec
        # Megatron hashes this into the dataset cache key.
        self.unique_identifiers: dict[str, Any] = {
            "class": type(self).__name__,
            "sha256": codec.sha256,
            "vocab_size": codec.vocab_size,
            "eod": codec.eod,
        }

    @property
    def vocab_size(self) -> int:  # type: ignore[override]
        return self.codec.vocab_size

    @property
    def eod(self) -> int:
        return self.codec.eod

    @property
    def vocab(self) -> dict[str, int]:  # type: ignore[override]
        return self.codec.vocab()

    def tokenize(self, text: str) -> list[int]:  # type: ignore[override]
        return self.codec.encode(text)

    def detokenize(self, ids: list[int]) -> str:  # type: ignore[override]
        return self.codec.decode(ids)

    def apply_chat_template(self, *args, **kwargs):  # type: ignore[override]  # noqa: ANN002,ANN003
        raise NotImplementedError(f"the {self.codec.kind} pretraining tokenizer has no chat template")


class ByteTokenizer(CodecTokenizer):
    """256 UTF-8 byte values + end-of-document 256: needs no file, covers any text."""

    EOD = 256

    def __init__(self) -> None:
        super().__init__(ByteCodec())
        self.unique_identifiers = {"class": "ByteTokenizer", "vocab_size": 257, "eod": self.EOD}


class HuggingFaceFileTokenizer(CodecTokenizer):
    """A local ``tokenizer.json`` (the ``tokenizers`` library); eod is its end-of-text token."""


class SentencePieceFileTokenizer(CodecTokenizer):
    """A local SentencePiece ``.model``; eod is its ``eos_id()``."""


_CLASSES: dict[str, type[CodecTokenizer]] = {
    "huggingface": HuggingFaceFileTokenizer,
    "sentencepiece": SentencePieceFileTokenizer,
}


def load_tokenizer(kind: str = "byte", path: str | Path | None = None) -> CodecTokenizer:
    """The tokenizer ``data.tokenizer``/``data.tokenizer_path`` name; ConfigError (one line) for a bad file."""
    codec = open_codec(kind, path)
    if kind == "byte":
        return ByteTokenizer()
    return _CLASSES[kind](codec)


def tokenizer_identity(kind: str = "byte", path: str | Path | None = None) -> dict[str, Any]:
    """Kind, file name, file SHA-256, vocabulary size and end-of-document id, for checkpoint manifests."""
    return open_codec(kind, path).identity()
