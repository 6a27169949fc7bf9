"""Update rules behind one interface: ``algorithm.update() -> UpdateResult``.

Each algorithm owns collection and optimisation of one update (it holds the collector,
the model and the optimizer); the trainer only anneals the learning rate, calls
``update()`` and logs. Every optimizer step goes through
:func:`rl_replay.algorithms.common.optimizer_step`.

=============  ==========================================================================
``a2c``        :class:`~rl_replay.algorithms.a2c.PolicyGradient`: GAE actor-critic
``reinforce``  :class:`~rl_replay.algorithms.a2c.PolicyGradient`: Monte-Carlo returns
``ppo``        :class:`~rl_replay.algorithms.ppo.PPO`: clipped surrogate, epochs x minibatches
=============  ==========================================================================
"""

from __future__ import annotations

import torch

from rl_replay import distributed as dist_utils
from rl_replay.algorithms.a2c import PolicyGradient, compute_loss
from rl_replay.algorithms.common import UpdateResult, clip_grad_norm, optimizer_step
from rl_replay.algorithms.ppo import PPO
from rl_replay.collector import Collector
from rl_replay.config import Config
from rl_replay.guards import StepGuard

__all__ = ["PPO", "PolicyGradient", "UpdateResult", "clip_grad_norm", "compute_loss",
           "make_algorithm", "optimizer_step"]


def make_algorithm(cfg: Config, collector: Collector, model: torch.nn.Module,
                   optimizer: torch.optim.Optimizer, info: dist_utils.DistInfo,
                   device: torch.device, guard: StepGuard | None = None) -> PolicyGradient | PPO:
    """The update rule named by ``cfg.loss.algorithm``; ``guard`` checks each optimizer step."""
    if cfg.loss.algorithm == "ppo":
        return PPO(cfg, collector, model, optimizer, info, device, guard=guard)
    return PolicyGradient(cfg, collector, model, optimizer, guard=guard)
