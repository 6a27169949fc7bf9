"""A2C and REINFORCE: one backward through the replay blocks of the rollout, one step."""

from __future__ import annotations

import time
from typing import Any

from rl_replay.algorithms.common import UpdateResult, optimizer_step
from rl_replay.collector import Collector
from rl_replay.config import Config
from rl_replay.guards import StepGuard
from rl_replay.losses import a2c_loss, reinforce_loss

__all__ = ["PolicyGradient", "compute_loss"]


def compute_loss(data, cfg) -> Any:
    """The named loss terms of a rollout for a :class:`~rl_replay.config.LossConfig` (a2c | reinforce)."""
    if cfg.algorithm == "a2c":
        return a2c_loss(
            data, gamma=cfg.gamma, gae_lambda=cfg.gae_lambda, value_coef=cfg.value_coef,
            entropy_coef=cfg.entropy_coef, normalize_advantages=cfg.normalize_advantages,
        )
    return reinforce_loss(
        data, gamma=cfg.gamma, baseline=cfg.baseline, value_coef=cfg.value_coef,
        entropy_coef=cfg.entropy_coef, normalize_advantages=cfg.normalize_advantages,
    )


class PolicyGradient:
    """A2C or REINFORCE (``cfg.loss.algorithm``): the rollout's outputs carry the graph.

    Collection records one replay block per step; the loss over the whole rollout is
    back-propagated once, which replays every block newest-first.
    """

    def __init__(self, cfg: Config, collector: Collector, model, optimizer,
                 guard: StepGuard | None = None) -> None:
        self.cfg = cfg
        self.collector = collector
        self.model = model
        self.optimizer = optimizer
        self.guard = guard

    def update(self) -> UpdateResult:
        t0 = time.perf_counter()
        rollout = self.collector.collect()
        t1 = time.perf_counter()
        terms = compute_loss(rollout.data, self.cfg.loss)
        grad_norm = optimizer_step(terms, self.model, self.optimizer, self.cfg.optim.max_grad_norm, self.guard)
        t2 = time.perf_counter()
        acc = rollout.accumulator
        metrics = {
            "memory/replay_saved_bytes": float(acc.saved_bytes),
            "time/replay_backward_sec": t2 - t1,
            "time/replay_recompute_sec": acc.replay_seconds,
        }
        for key, value in terms.items():
            metrics["train/" + key] = float(value.detach())
        return UpdateResult(rollout, metrics, float(grad_norm), collect_sec=t1 - t0, optimize_sec=t2 - t1)
