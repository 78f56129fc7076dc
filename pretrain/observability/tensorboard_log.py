"""TensorBoard scalars from rank 0 under ``logging.tensorboard_dir``, with the tags Megatron-LM
users know (``lm loss``, ``lm loss validation``, ``learning-rate``, ``grad-norm``, ``throughput``).

Every attempt appends a new event file to the same directory; steps recomputed after a restore
are written again (TensorBoard shows the newest value). Off (a no-op) when the directory is unset
or on other ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class TensorBoardLog:
    def __init__(self, directory: str | None, enabled: bool) -> None:
        self.writer: Any = None
        if directory and enabled:
            # Deferred: tensorboard is only loaded by runs that ask for it.
            from torch.utils.tensorboard import SummaryWriter

            Path(directory).mkdir(parents=True, exist_ok=True)
            self.writer = SummaryWriter(log_dir=directory)

    def step(self, step: int, loss: float, lr: float, grad_norm: float, tokens_per_s: float | None) -> None:
        if self.writer is None:
            return
        self.writer.add_scalar("lm loss", loss, step)
        self.writer.add_scalar("learning-rate", lr, step)
        self.writer.add_scalar("grad-norm", grad_norm, step)
        if tokens_per_s is not None:
            self.writer.add_scalar("throughput", tokens_per_s, step)

    def validation(self, step: int, loss: float) -> None:
        if self.writer is not None:
            self.writer.add_scalar("lm loss validation", loss, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
