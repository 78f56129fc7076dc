"""One micro-batch through the model, and the loss Megatron's pipeline schedules reduce: shared by
training and evaluation so that both compute the same loss."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.distributed as dist


def forward_step(
    data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]]:
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(masked_mean_loss, batch["loss_mask"])


def masked_mean_loss(loss_mask: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    losses = output.float().reshape(-1)
    mask = loss_mask.float().reshape(-1)
    loss = (losses * mask).sum() / mask.sum().clamp(min=1.0)
    # clone: the schedule divides the returned loss in place by the number of micro-batches
    return loss, {"lm loss": loss.detach().clone()}


def reduce_losses(losses: list[dict[str, torch.Tensor]], leave: bool = False) -> tuple[float, bool]:
    """Mean micro-batch loss over the world (only last-stage ranks contribute), and whether any
    rank was asked to leave: one all-reduce, so every rank agrees on the step to stop at."""
    total = torch.zeros(3, dtype=torch.float64)
    for item in losses or []:
        total[0] += float(item["lm loss"])
        total[1] += 1
    total[2] = 1.0 if leave else 0.0
    dist.all_reduce(total)
    loss = float(total[0] / total[1]) if total[1] > 0 else float("nan")
    return loss, bool(total[2] > 0)
