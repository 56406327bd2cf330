"""The training loop's parts for the encoder distillation (distill.py): a run's inputs, the
optimiser, the schedule and the step."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..core.prefill.anchor import DEFAULT_ANCHOR


@dataclass
class TrainingRun:
    """The settings every training run has; each kind adds its own (and its own defaults)."""

    model: str | None = None  # a bundled model name or a folder; None: the default model
    data: str = ""  # the training set (JSONL)
    out: str = ""  # where the trained file goes
    steps: int = 200
    lr: float = 5e-5
    warmup: int = 10
    seed: int = 0
    anchor: str = DEFAULT_ANCHOR  # must be the anchor the engine will encode chunks after
    max_tokens: int = 1536  # longer examples are skipped (CPU memory and step time)


def optimizer(params: Sequence[torch.Tensor], lr: float, warmup: int, steps: int,
              weight_decay: float = 0.0):
    """AdamW with a linear warm-up over `warmup` steps and a linear decay to 0 at `steps`."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, warmup)) * max(0.0, 1 - s / max(1, steps)))
    return opt, sched


def step(loss: torch.Tensor, params: Sequence[torch.Tensor], opt, sched) -> float:
    """Backward, clip the gradient norm to 1, one optimiser and schedule step; the loss value."""
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def report(log: Callable[[str], None], done: int, steps: int, losses: Sequence[float],
           started: float, name: str = "loss") -> None:
    """Log the mean of the last ten losses after the first step and every ten."""
    if done % 10 == 0 or done == 1:
        recent = losses[-10:]
        log(f"step {done}/{steps} {name} {sum(recent) / len(recent):.4f} "
            f"({time.perf_counter() - started:.0f}s)")
