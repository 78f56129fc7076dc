"""Schema of ``data`` (datasets, blends, tokenizer, batch sizes, split) and ``eval`` (validation)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pretrain.config.fail import Fail, positive


@dataclass
class BlendPart:
    """One dataset of a blend: a prepared ``prefix`` (``.bin``/``.idx``) and its weight."""

    prefix: str = ""  # a prepared dataset (PREFIX.bin, PREFIX.idx)
    weight: float = 1.0  # its share of the samples (normalised over the blend)


@dataclass
class DataConfig:
    prefix: str = "runs/data/corpus"  # a prepared Megatron indexed dataset (PREFIX.bin, PREFIX.idx)
    # byte: no file; huggingface: a local tokenizer.json (or a directory holding one);
    # sentencepiece: a local .model. Read offline from tokenizer_path.
    tokenizer: Literal["byte", "huggingface", "sentencepiece"] = "byte"
    tokenizer_path: str | None = None  # the tokenizer file (none for byte)
    global_batch_size: int = 8  # samples per step over all data-parallel ranks
    micro_batch_size: int = 2  # samples per forward/backward on one rank
    cache_dir: str | None = None  # where Megatron caches the dataset's sample index (None: beside the data)
    # Several prefixes with weights ([{prefix: ..., weight: ...}, ...]); when set, ``prefix`` is unused.
    blend: list[BlendPart] = field(default_factory=list)
    # Megatron's train,valid,test split of each prefix (weights, normalised): "98,2,0" holds out 2 %
    # for validation. The default keeps everything for training.
    split: str = "100,0,0"
    # Record every rank's consumed sample positions (data-audit/rank-N.jsonl) for exactness checks.
    audit: bool = False

    def check(self, fail: Fail) -> None:
        positive(fail, global_batch_size=self.global_batch_size, micro_batch_size=self.micro_batch_size)
        for i, part in enumerate(self.blend):
            if not part.prefix or part.weight < 0:
                fail(f"blend[{i}]", "needs a prefix and a weight >= 0", "write {prefix: PATH, weight: W}")
        if self.blend and sum(p.weight for p in self.blend) <= 0:
            fail("blend", "every weight is zero", "give at least one dataset a positive weight")
        parts = self.split.replace("/", ",").split(",")
        try:
            weights = [float(p) for p in parts]
        except ValueError:
            weights = []
        if len(weights) != 3 or min(weights) < 0 or sum(weights) <= 0:
            fail("split", f"{self.split!r} is not three non-negative weights", "write train,valid,test, e.g. 98,2,0")
        if self.tokenizer == "byte" and self.tokenizer_path:
            fail("tokenizer_path", "the byte tokenizer reads no file", "remove it, or set data.tokenizer to its kind")
        if self.tokenizer != "byte" and not self.tokenizer_path:
            fail(
                "tokenizer_path",
                f"data.tokenizer={self.tokenizer} needs a local tokenizer file",
                "set it to a tokenizer.json (huggingface) or a .model (sentencepiece)",
            )

    def prefixes(self) -> list[tuple[str, float]]:
        """(prefix, weight) of every dataset trained on: the blend, or ``prefix`` alone."""
        return [(p.prefix, p.weight) for p in self.blend if p.weight > 0] or [(self.prefix, 1.0)]

    def split_weights(self) -> list[float]:
        weights = [float(p) for p in self.split.replace("/", ",").split(",")]
        return [w / sum(weights) for w in weights]


@dataclass
class EvalConfig:
    """Validation loss on the valid split every ``interval`` steps (0: never), over ``iters`` global
    batches. It draws no training randomness: a run with evaluation resumes bit-exactly."""

    interval: int = 0  # steps between validation runs (0: never)
    iters: int = 2  # global batches of the valid split per validation run

    def check(self, fail: Fail) -> None:
        if self.interval < 0 or self.iters < 1:
            fail("interval", "interval must be >= 0 and iters >= 1", "e.g. eval.interval: 200, eval.iters: 10")
