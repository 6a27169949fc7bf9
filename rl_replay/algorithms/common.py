"""What every algorithm shares: the one optimizer step and the result of an update."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tensordict import TensorDict

from rl_replay.algorithms.losses import total_loss
from rl_replay.guards import StepGuard
from rl_replay.rollout.collector import Rollout

__all__ = ["UpdateResult", "clip_grad_norm", "optimizer_step"]


@dataclass
class UpdateResult:
    """What one update hands back to the trainer.

    Attributes:
        rollout: the rollout it collected (episode statistics and env steps are read here).
        metrics: this rank's scalar diagnostics, keyed as logged (``train/...``,
            ``memory/...``, ``time/...``); the trainer averages them over ranks.
        grad_norm: mean pre-clip gradient norm over the update's optimizer steps.
        collect_sec: wall time of collection.
        optimize_sec: wall time of everything after collection (losses, backward, steps).
    """

    rollout: Rollout
    metrics: dict[str, float] = field(default_factory=dict)
    grad_norm: float = float("nan")
    collect_sec: float = 0.0
    optimize_sec: float = 0.0


def clip_grad_norm(model: torch.nn.Module, max_norm: float | None) -> torch.Tensor:
    """Clip the global gradient norm of ``model`` (None = no clip); returns the pre-clip norm.

    Under FSDP1 the model's own ``clip_grad_norm_`` computes the norm over all shards; under FSDP2
    the gradients are DTensors, whose norm is made whole over the ranks before it scales them (as
    torchtitan clips).
    """
    max_norm = max_norm or float("inf")
    if hasattr(model, "clip_grad_norm_"):
        return model.clip_grad_norm_(max_norm)  # type: ignore[operator]
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    if hasattr(norm, "full_tensor"):  # a DTensor: each rank holds its shards' part of the norm
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
    return norm


def optimizer_step(
    terms: TensorDict,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float | None,
    guard: StepGuard | None = None,
) -> torch.Tensor:
    """backward of ``total_loss(terms)`` -> clip -> ``optimizer.step()`` -> ``zero_grad``.

    Every optimizer step of every algorithm goes through here, so the run's non-finite
    checks (``guard``, see :class:`rl_replay.guards.StepGuard`) live in this one place: a
    non-finite loss term or gradient norm skips the step (within the run's skip budget) or
    raises before the optimizer sees it, and non-finite parameters after the step raise.
    Returns the pre-clip gradient norm.
    """
    total_loss(terms).backward()  # replays every block of the graph, newest first
    grad_norm = clip_grad_norm(model, max_grad_norm)
    if guard is None or guard.allows_step(terms, grad_norm):
        optimizer.step()
        if guard is not None:
            guard.after_step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm
