"""A2C: GAE advantages and a learned critic, one backward through the rollout's replay blocks."""

from __future__ import annotations

from tensordict import TensorDict

from rl_replay.algorithms.losses import a2c_loss
from rl_replay.algorithms.policy_gradient import PolicyGradient
from rl_replay.config import Config

__all__ = ["A2C"]


class A2C(PolicyGradient):
    """Advantage actor-critic (:func:`rl_replay.algorithms.losses.a2c_loss`); no advantage normalisation by default."""

    @classmethod
    def loss(cls, data: TensorDict, cfg: Config, entropy_coef: float | None = None) -> TensorDict:
        return a2c_loss(
            data, gamma=cfg.loss.gamma, gae_lambda=cfg.loss.gae_lambda, **cls.loss_weights(cfg, entropy_coef)
        )
