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
        loss_cfg = cfg.loss
        return a2c_loss(
            data,
            gamma=loss_cfg.gamma,
            gae_lambda=loss_cfg.gae_lambda,
            value_coef=loss_cfg.value_coef,
            entropy_coef=loss_cfg.entropy_coef if entropy_coef is None else entropy_coef,
            normalize_advantages=cls.normalize_advantages(loss_cfg),
        )
