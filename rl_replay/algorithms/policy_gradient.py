"""What A2C and REINFORCE share: the rollout is collected as replay blocks, one backward, one step."""

from __future__ import annotations

import time
from abc import abstractmethod

from tensordict import TensorDict

from rl_replay.algorithms.base import Algorithm
from rl_replay.algorithms.common import UpdateResult, optimizer_step
from rl_replay.config import LossConfig

__all__ = ["PolicyGradient"]


class PolicyGradient(Algorithm):
    """An on-policy update whose rollout outputs carry the graph; subclasses give :meth:`loss`.

    Collection records one replay block per step; the loss over the whole rollout is
    back-propagated once, which replays every block newest-first.
    """

    @classmethod
    @abstractmethod
    def loss(cls, data: TensorDict, loss: LossConfig) -> TensorDict:
        """The named loss terms (see :mod:`rl_replay.losses`) of a collected (T, N) rollout."""

    def update(self) -> UpdateResult:
        t0 = time.perf_counter()
        rollout = self.collector.collect()
        t1 = time.perf_counter()
        terms = self.loss(rollout.data, self.cfg.loss)
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
