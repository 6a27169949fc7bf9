"""REINFORCE: Monte-Carlo returns, optionally a learned baseline, one backward through the rollout."""

from __future__ import annotations

from tensordict import TensorDict

from rl_replay.algorithms.losses import reinforce_loss
from rl_replay.algorithms.policy_gradient import PolicyGradient
from rl_replay.config import Config

__all__ = ["REINFORCE"]


class REINFORCE(PolicyGradient):
    """REINFORCE (:func:`rl_replay.algorithms.losses.reinforce_loss`); no advantage normalisation by default."""

    @classmethod
    def loss(cls, data: TensorDict, cfg: Config, entropy_coef: float | None = None) -> TensorDict:
        loss_cfg = cfg.loss
        return reinforce_loss(
            data,
            gamma=loss_cfg.gamma,
            baseline=loss_cfg.baseline,
            value_coef=loss_cfg.value_coef,
            entropy_coef=loss_cfg.entropy_coef if entropy_coef is None else entropy_coef,
            normalize_advantages=cls.normalize_advantages(loss_cfg),
        )
