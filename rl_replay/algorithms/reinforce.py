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
        return reinforce_loss(
            data, gamma=cfg.loss.gamma, baseline=cfg.loss.baseline, **cls.loss_weights(cfg, entropy_coef)
        )
