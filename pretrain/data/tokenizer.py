"""A byte-level tokenizer: needs no download, covers any UTF-8 text, 256 bytes + end-of-document."""

from __future__ import annotations

from megatron.core.tokenizers import MegatronTokenizerBase


class ByteTokenizer(MegatronTokenizerBase):
    EOD = 256

    def __init__(self) -> None:
        super().__init__(path="", config={})
        # Megatron hashes this into the dataset cache key.
        self.unique_identifiers = {"class": "ByteTokenizer", "vocab_size": 257, "eod": self.EOD}

    @property
    def vocab_size(self) -> int:  # type: ignore[override]
        return 257

    @property
    def eod(self) -> int:
        return self.EOD

    @property
    def vocab(self) -> dict[str, int]:  # type: ignore[override]
        return {**{chr(i): i for i in range(256)}, "<eod>": self.EOD}

    def tokenize(self, text: str) -> list[int]:  # type: ignore[override]
        return list(text.encode("utf-8"))

    def detokenize(self, ids: list[int]) -> str:  # type: ignore[override]
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, *args, **kwargs):  # type: ignore[override]  # noqa: ANN002,ANN003
        raise NotImplementedError("the byte tokenizer has no chat template")
