"""The interface every algorithm implements: one constructor, ``update() -> UpdateResult``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from tensordict import TensorDict

from rl_replay import distributed as dist_utils
from rl_replay.agent import Policy
from rl_replay.algorithms.common import UpdateResult
from rl_replay.algorithms.horizon import episode_horizon
from rl_replay.algorithms.schedules import RunProgress, entropy_coef_at, learning_rate_at
from rl_replay.config import Config, LossConfig
from rl_replay.guards import StepGuard
from rl_replay.rollout.collector import Collector

__all__ = ["Algorithm"]


class Algorithm(ABC):
    """One update rule: collection and optimisation of one update.

    Every algorithm is built with the same arguments (:func:`rl_replay.algorithms.make_algorithm`
    looks the class up by ``cfg.loss.algorithm`` and calls it) and owns what one update needs; the
    trainer calls :meth:`update` with where the run stands (:class:`~rl_replay.algorithms.schedules.RunProgress`)
    and logs what comes back, and the algorithm sets its learning rate and entropy weight from the
    progress itself. Optimizer steps go through :func:`rl_replay.algorithms.common.optimizer_step` with ``guard``.

    Args:
        cfg: the run's config (an algorithm reads its own sections).
        collector: collects the rollouts.
        model: what the collector calls (the FSDP-wrapped root under FSDP).
        optimizer: steps ``model``'s parameters.
        info: this process's rank and world size (one process when None).
        device: where the model lives (collectives of a decision taken over ranks).
        guard: the run's non-finite checks on every optimizer step (None = no checks).
    """

    #: Whether advantages are normalised when ``loss.normalize_advantages`` is None.
    normalizes_advantages_by_default: ClassVar[bool] = False

    def __init__(
        self,
        cfg: Config,
        collector: Collector,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        info: dist_utils.DistInfo | None = None,
        device: torch.device | str = "cpu",
        guard: StepGuard | None = None,
    ) -> None:
        self.cfg = cfg
        self.collector = collector
        #: The agent and the module that runs it (under FSDP the wrapper): one handle.
        self.policy = Policy.of(model)
        self.bptt_truncate = cfg.collector.bptt_truncate
        self.optimizer = optimizer
        self.info = info or dist_utils.DistInfo()
        self.device = torch.device(device)
        self.guard = guard
        #: The entropy bonus's weight in this update's loss, moved along ``loss.entropy_schedule``
        #: by :meth:`update` (:func:`rl_replay.algorithms.schedules.entropy_coef_at`).
        self.entropy_coef = cfg.loss.entropy_coef

    @property
    def model(self) -> torch.nn.Module:
        """What the collector and the replay blocks call, and the optimizer steps (``policy.module``)."""
        return self.policy.module

    def horizon(self, data: TensorDict) -> dict[str, float]:
        """``horizon/*`` metrics of a collected (T, N) rollout: how far back this algorithm's
        gradient reaches, replayed as its update replays (:func:`rl_replay.algorithms.horizon.episode_horizon`)."""
        # replayed in blocks of replay.block_steps, as the update re-runs its stored sequences
        return episode_horizon(self.policy, data, self.bptt_truncate, block_steps=self.cfg.replay.block_steps)

    @classmethod
    @abstractmethod
    def loss(cls, data: TensorDict, cfg: Config, entropy_coef: float | None = None) -> TensorDict:
        """The named loss terms (:mod:`rl_replay.algorithms.losses`) of ``data`` (the collected
        (T, N) rollout; PPO: one minibatch) under the run's settings ``cfg``, the same signature
        for every algorithm; ``entropy_coef`` in place of ``cfg.loss.entropy_coef`` when given
        (the schedule's weight at this update)."""

    def update(self, progress: RunProgress | None = None) -> UpdateResult:
        """Collect one rollout and optimise on it; returns the rollout and this rank's metrics.

        ``progress`` (where the run stands; None: leave the learning rate and the entropy weight
        as they are) sets the learning rate (``optim.anneal_lr``), the entropy weight
        (``loss.entropy_schedule``) and the update the guard names in a refusal.
        """
        if progress is not None:
            lr = learning_rate_at(self.cfg, progress.budget_used)
            if self.cfg.optim.anneal_lr:
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
            self.entropy_coef = entropy_coef_at(self.cfg, progress.env_steps)
            if self.guard is not None:
                self.guard.begin(progress.update, progress.last_checkpoint)
        return self._update()

    @abstractmethod
    def _update(self) -> UpdateResult:
        """One update's collection and optimisation, the algorithm's own (see :meth:`update`)."""

    @classmethod
    def loss_weights(cls, cfg: Config, entropy_coef: float | None = None) -> dict[str, Any]:
        """The keyword arguments every loss of :mod:`rl_replay.algorithms.losses` takes from the
        run's settings: ``value_coef``, ``entropy_coef`` (``entropy_coef`` when given: the
        schedule's weight at this update) and ``normalize_advantages``."""
        return {
            "value_coef": cfg.loss.value_coef,
            "entropy_coef": cfg.loss.entropy_coef if entropy_coef is None else entropy_coef,
            "normalize_advantages": cls.normalize_advantages(cfg.loss),
        }

    @classmethod
    def normalize_advantages(cls, loss_cfg: LossConfig) -> bool:
        """``loss.normalize_advantages``, or this algorithm's default where it is None."""
        if loss_cfg.normalize_advantages is None:
            return cls.normalizes_advantages_by_default
        return loss_cfg.normalize_advantages
