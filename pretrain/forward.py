"""One micro-batch through the model, and the loss Megatron's pipeline schedules reduce: shared by
training and evaluation so that both compute the same loss."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.distributed as dist


def compute_device() -> torch.device:
    """Where the model and its inputs live: this rank's GPU on CUDA hosts, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def forward_step(
    data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]]:
    device = compute_device()
    batch = {k: v.to(device, non_blocking=True) for k, v in next(data_iterator).items()}
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
    values = [float(item["lm loss"]) for item in losses or []]
    # On the collective's device: NCCL reduces CUDA tensors only, gloo CPU tensors.
    device = compute_device() if dist.get_backend() == "nccl" else torch.device("cpu")
    total = torch.tensor([sum(values), len(values), 1.0 if leave else 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    total = total.cpu()
    loss = float(total[0] / total[1]) if total[1] > 0 else float("nan")
    return loss, bool(total[2] > 0)
