"""Validation loss: the same forward pass and loss as training, on the valid split, in eval mode.

The samples are fixed (the first ``eval.iters`` global batches of the valid split, in order, each
data-parallel rank taking its contiguous slice as in training), so every evaluation of the same
weights sees the same tokens at any DP size. Evaluation draws no training randomness: dropout is
off in eval mode and every RNG stream (Python, NumPy, torch CPU/CUDA, Megatron's CUDA tracker) is
put back as it was, so a run with evaluation trains bit-for-bit like one without and resumes
exactly. Collective over the training group.
"""

from __future__ import annotations

import math

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.pipeline_parallel import get_forward_backward_func

from pretrain.config import Config
from pretrain.forward import forward_step, reduce_losses
from pretrain.rank_state import capture_rng, restore_rng


class Evaluator:
    def __init__(
        self, cfg: Config, valid: torch.utils.data.Dataset, ddp: DistributedDataParallel, dp_rank: int, dp_size: int
    ) -> None:
        self.cfg = cfg
        self.valid = valid
        self.ddp = ddp
        self.dp_rank = dp_rank
        self.per_rank = cfg.data.global_batch_size // dp_size

    def due(self, step: int) -> bool:
        return bool(self.cfg.eval.interval) and step % self.cfg.eval.interval == 0

    def _microbatches(self, batch: int) -> list[dict[str, torch.Tensor]]:
        gbs, mbs = self.cfg.data.global_batch_size, self.cfg.data.micro_batch_size
        start = batch * gbs + self.dp_rank * self.per_rank
        indices = [(start + i) % len(self.valid) for i in range(self.per_rank)]
        out = []
        for i in range(0, len(indices), mbs):
            samples = [self.valid[j] for j in indices[i : i + mbs]]
            out.append({k: torch.stack([s[k] for s in samples]) for k in samples[0]})
        return out

    def loss(self) -> float:
        """Mean validation loss over ``eval.iters`` global batches (NaN only if no rank computed one)."""
        rng = capture_rng()
        forward_backward = get_forward_backward_func()
        self.ddp.eval()
        total, count = 0.0, 0
        try:
            with torch.no_grad():
                for batch in range(self.cfg.eval.iters):
                    micro = self._microbatches(batch)
                    losses = forward_backward(
                        forward_step_func=forward_step,
                        data_iterator=iter(micro),
                        model=[self.ddp],
                        num_microbatches=len(micro),
                        seq_length=self.cfg.model.seq_length,
                        micro_batch_size=self.cfg.data.micro_batch_size,
                        forward_only=True,
                    )
                    loss, _ = reduce_losses(losses)
                    if math.isfinite(loss):
                        total, count = total + loss, count + 1
        finally:
            self.ddp.train()
            restore_rng(rng)
        return total / count if count else float("nan")
