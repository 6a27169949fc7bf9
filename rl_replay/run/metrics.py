"""One update's logged metrics: this rank's numbers pooled over ranks into one row.

Episode statistics (returns, lengths, successes, env steps) are pooled as sums and counts,
so ``rollout/return_mean`` is the mean over every episode that ended on any rank, not a
mean of per-rank means. Every other scalar (losses, times, memory) is this rank's value,
averaged over ranks. Outside torchrun both reductions return their input unchanged.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import numpy as np
import torch

from rl_replay import distributed as dist_utils
from rl_replay.run.memory_stats import update_memory

if TYPE_CHECKING:
    from rl_replay.algorithms.common import UpdateResult

__all__ = ["pool_update_metrics"]


def pool_update_metrics(
    result: UpdateResult,
    *,
    recent_returns: Collection[float],
    lr: float,
    skipped_updates: int,
    device: torch.device,
    info: dist_utils.DistInfo,
) -> tuple[dict[str, float], int]:
    """The metric row of one update and the env steps it took on all ranks together.

    ``recent_returns`` are this rank's last episode returns, this update's included
    (``rollout/return_recent``); ``lr`` and ``skipped_updates`` are logged as they are.
    Collective under torchrun: every rank calls it once per update.
    """
    rollout = result.rollout
    update_sec = result.collect_sec + result.optimize_sec
    pooled = dist_utils.reduce_sums(
        {
            "steps": rollout.env_steps,
            "episodes": len(rollout.episode_returns),
            "return": sum(rollout.episode_returns),
            "length": sum(rollout.episode_lengths),
            "judged": len(rollout.episode_successes),
            "success": sum(rollout.episode_successes),
        },
        device,
        info,
    )
    steps = pooled["steps"]
    nan = float("nan")
    episodes, judged = pooled["episodes"], pooled["judged"]
    local = {
        "rollout/return_recent": float(np.mean(recent_returns)) if recent_returns else nan,  # type: ignore[call-overload]
        **result.metrics,
        "time/collect_sec": result.collect_sec,
        "time/optimize_sec": result.optimize_sec,
        "time/update_sec": update_sec,
        **update_memory(device),
    }
    metrics = dist_utils.reduce_mean(local, device, info)
    metrics["rollout/episodes"] = episodes
    metrics["rollout/return_mean"] = pooled["return"] / episodes if episodes else nan
    metrics["rollout/episode_length"] = pooled["length"] / episodes if episodes else nan
    metrics["rollout/success_rate"] = pooled["success"] / judged if judged else nan
    metrics["train/grad_norm"] = result.grad_norm
    metrics["train/lr"] = lr
    metrics["train/skipped_updates"] = float(skipped_updates)
    metrics["time/steps_per_sec"] = steps / update_sec
    return metrics, int(steps)
