"""Update rules behind one interface: ``algorithm.update() -> UpdateResult``.

Every algorithm is an :class:`~rl_replay.algorithms.base.Algorithm` built with the same
arguments, ``cls(cfg, collector, model, optimizer, info=..., device=..., guard=...)``. Each
owns collection and optimisation of one update (it holds the collector, the model and the
optimizer); the trainer only anneals the learning rate, calls ``update()`` and logs. Every
optimizer step goes through :func:`rl_replay.algorithms.common.optimizer_step`; the loss
math is pure functions in :mod:`rl_replay.algorithms.losses`.

=============  ==========================================================================
``a2c``        :class:`~rl_replay.algorithms.a2c.A2C`: GAE actor-critic
``reinforce``  :class:`~rl_replay.algorithms.reinforce.REINFORCE`: Monte-Carlo returns
``ppo``        :class:`~rl_replay.algorithms.ppo.PPO`: clipped surrogate, epochs x minibatches
=============  ==========================================================================

A fourth algorithm is one new module (a subclass of ``Algorithm``, or of
:class:`~rl_replay.algorithms.policy_gradient.PolicyGradient` for a one-backward rollout
loss) plus one line in :data:`rl_replay.registry.ALGORITHMS`::

    "sac": "my_pkg.sac:SAC",
"""

from __future__ import annotations

import torch

from rl_replay import distributed as dist_utils
from rl_replay.algorithms.a2c import A2C
from rl_replay.algorithms.base import Algorithm
from rl_replay.algorithms.common import UpdateResult, clip_grad_norm, optimizer_step
from rl_replay.algorithms.ppo import PPO
from rl_replay.algorithms.reinforce import REINFORCE
from rl_replay.config import Config
from rl_replay.guards import StepGuard
from rl_replay.registry import ALGORITHMS
from rl_replay.rollout.collector import Collector
from rl_replay.targets import resolve

__all__ = [
    "A2C",
    "PPO",
    "REGISTRY",
    "REINFORCE",
    "Algorithm",
    "UpdateResult",
    "clip_grad_norm",
    "make_algorithm",
    "optimizer_step",
]

#: ``loss.algorithm`` -> the class that runs it (resolved from :data:`rl_replay.registry.ALGORITHMS`).
REGISTRY: dict[str, type[Algorithm]] = {name: resolve(target, "loss.algorithm") for name, target in ALGORITHMS.items()}


def make_algorithm(
    cfg: Config,
    collector: Collector,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    info: dist_utils.DistInfo,
    device: torch.device,
    guard: StepGuard | None = None,
) -> Algorithm:
    """The update rule named by ``cfg.loss.algorithm``; ``guard`` checks each optimizer step."""
    try:
        cls = REGISTRY[cfg.loss.algorithm]
    except KeyError:
        raise ValueError(
            f"Invalid value for config key 'loss.algorithm': {cfg.loss.algorithm!r}. Registered: {', '.join(REGISTRY)}"
        ) from None
    return cls(cfg, collector, model, optimizer, info=info, device=device, guard=guard)
