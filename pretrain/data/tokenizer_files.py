"""Tokenizer files, offline: open a tokenizer by kind and local path, and say who it is.

Contract: :func:`open_codec` returns a :class:`Codec` (``encode``, ``decode``, ``vocab_size``,
``eod``, ``sha256``) for one of :data:`KINDS`:

* ``byte``: no file; 256 byte values plus end-of-document 256 (vocabulary 257).
* ``huggingface``: a ``tokenizer.json`` of the ``tokenizers`` library, or a directory holding one.
* ``sentencepiece``: a SentencePiece ``.model`` (or a directory holding ``tokenizer.model``).

Only local files are read; nothing is downloaded. The end-of-document id is the tokenizer's own
end-of-text token (:data:`EOD_TOKENS`; SentencePiece: ``eos_id()``). Every problem with a file
(missing, unreadable, of another kind, without an end-of-document token) is a one-line
:class:`ConfigError` naming the file and the fix. Text is encoded without added special tokens
(no BOS): documents are separated by the end-of-document id alone.

Nothing here imports torch or Megatron: config validation and prepare-data's spawned workers use
this module and must start fast. :mod:`pretrain.data.tokenizer` wraps a codec as a Megatron tokenizer.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sentencepiece
from tokenizers import Tokenizer

from pretrain.errors import ConfigError

KINDS = ("byte", "huggingface", "sentencepiece")
# End-of-document tokens, in the order they are looked for (GPT-2/Qwen, Llama 3, Llama 2/Mistral, Gemma).
EOD_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
_DIR_FILE = {"huggingface": "tokenizer.json", "sentencepiece": "tokenizer.model"}


def _one_line(exc: BaseException, limit: int = 120) -> str:
    return " ".join(str(exc).split())[:limit] or type(exc).__name__


class Codec:
    """A tokenizer reduced to what pretraining needs; subclasses set the fields in ``__init__``."""

    kind: str
    path: Path | None
    sha256: str | None  # of the tokenizer file's bytes (None: the byte tokenizer has no file)
    vocab_size: int
    eod: int

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def vocab(self) -> dict[str, int]:
        raise NotImplementedError

    def identity(self) -> dict[str, Any]:
        """What a checkpoint manifest records of the tokenizer."""
        return {
            "kind": self.kind,
            "file": self.path.name if self.path else None,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "eod": self.eod,
        }


class ByteCodec(Codec):
    """UTF-8 bytes 0-255 and end-of-document 256."""

    def __init__(self) -> None:
        self.kind, self.path, self.sha256 = "byte", None, None
        self.vocab_size, self.eod = 257, 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def vocab(self) -> dict[str, int]:
        return {**{chr(i): i for i in range(256)}, "<eod>": self.eod}


class HuggingFaceCodec(Codec):
    """A ``tokenizer.json`` read with the ``tokenizers`` library (no ``transformers``)."""

    def __init__(self, path: Path, data: bytes) -> None:
        self.kind, self.path, self.sha256 = "huggingface", path, hashlib.sha256(data).hexdigest()
        try:
            self._tok = Tokenizer.from_str(data.decode("utf-8"))
        except UnicodeDecodeError:
            raise ConfigError(_wrong_kind(path, "huggingface", "not UTF-8 text")) from None
        except Exception as exc:  # the Rust library raises a bare Exception for any parse error
            raise ConfigError(_wrong_kind(path, "huggingface", _one_line(exc))) from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        if not vocab:
            raise ConfigError(_wrong_kind(path, "huggingface", "its vocabulary is empty"))
        self.vocab_size = max(vocab.values()) + 1
        found = [vocab[t] for t in EOD_TOKENS if t in vocab]
        if not found:
            raise ConfigError(
                f"{path}: no end-of-document token (looked for {', '.join(EOD_TOKENS)}); fix: add one as a "
                "special token (pretrain train-tokenizer --special-tokens '<|endoftext|>') or use a tokenizer with one"
            )
        self.eod = found[0]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [enc.ids for enc in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)


class SentencePieceCodec(Codec):
    """A SentencePiece ``.model`` read with the ``sentencepiece`` library."""

    def __init__(self, path: Path, data: bytes) -> None:
        self.kind, self.path, self.sha256 = "sentencepiece", path, hashlib.sha256(data).hexdigest()
        if not data:
            raise ConfigError(_wrong_kind(path, "sentencepiece", "the file is empty"))
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_proto=data)
        except (RuntimeError, OSError) as exc:
            reason = "cannot parse it as a model" if "ParseFromArray" in str(exc) else _one_line(exc)
            raise ConfigError(_wrong_kind(path, "sentencepiece", reason)) from None
        self.vocab_size = self._sp.get_piece_size()
        if self.vocab_size < 1:
            raise ConfigError(_wrong_kind(path, "sentencepiece", "it has no pieces"))
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise ConfigError(
                f"{path}: the SentencePiece model has no end-of-sentence id (eos_id is -1); "
                "fix: retrain it with an eos piece (SentencePieceTrainer eos_id=2, the default)"
            )

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(ids))

    def vocab(self) -> dict[str, int]:
        return {self._sp.id_to_piece(i): i for i in range(self.vocab_size)}


def _wrong_kind(path: Path, kind: str, reason: str) -> str:
    if kind == "huggingface":
        return (
            f"{path}: not a Hugging Face tokenizer.json ({reason}); fix: give a tokenizer.json saved by the "
            "tokenizers library (pretrain train-tokenizer writes one), or tokenizer sentencepiece for a .model"
        )
    return (
        f"{path}: not a SentencePiece model ({reason}); fix: give a .model written by SentencePieceTrainer, "
        "or tokenizer huggingface for a tokenizer.json"
    )


def tokenizer_file(kind: str, path: str | Path | None) -> Path | None:
    """The file a tokenizer of ``kind`` reads (a directory names its standard file); None for byte."""
    if kind not in KINDS:
        raise ConfigError(f"{path or '<no path>'}: unknown tokenizer {kind!r}; fix: use one of {', '.join(KINDS)}")
    if kind == "byte":
        if path:
            raise ConfigError(
                f"{path}: the byte tokenizer reads no file; fix: drop the tokenizer path, or choose the "
                "huggingface or sentencepiece tokenizer for it"
            )
        return None
    if not path:
        raise ConfigError(
            f"<no path>: the {kind} tokenizer needs a local {_DIR_FILE[kind]}; fix: set data.tokenizer_path "
            "(prepare-data: --tokenizer-path) to the file"
        )
    file = Path(path)
    if file.is_dir():
        file = file / _DIR_FILE[kind]
        if not file.is_file():
            raise ConfigError(f"{path}: directory holds no {_DIR_FILE[kind]}; fix: name the tokenizer file itself")
    elif not file.exists():
        raise ConfigError(f"{file}: tokenizer file not found; fix: give the path of a local {_DIR_FILE[kind]}")
    return file


def open_codec(kind: str, path: str | Path | None = None) -> Codec:
    """The tokenizer of ``kind`` at ``path``, from local files only (cached while the file is unchanged)."""
    file = tokenizer_file(kind, path)
    if file is None:
        return ByteCodec()
    try:
        stat = file.stat()
    except OSError as exc:
        raise ConfigError(f"{file}: cannot stat tokenizer file ({exc.strerror}); fix: check the path") from None
    return _open_file(kind, str(file), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _open_file(kind: str, file: str, _mtime_ns: int, _size: int) -> Codec:
    path = Path(file)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"{path}: cannot read tokenizer file ({exc.strerror}); fix: make it readable or copy it elsewhere"
        ) from None
    return HuggingFaceCodec(path, data) if kind == "huggingface" else SentencePieceCodec(path, data)


def tokenizer_vocab_size(kind: str, path: str | Path | None = None) -> int:
    """The tokenizer's vocabulary size (largest id + 1)."""
    return open_codec(kind, path).vocab_size
