"""A feed-forward actor-critic (separate actor and critic MLPs, CleanRL-style init)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict
from torch import nn

from rl_replay.agent import ActionHead, Agent, value_head


def mlp(in_features: int, hidden_sizes: Sequence[int], activation=nn.Tanh) -> nn.Sequential:
    """Linear + activation layers with orthogonal init (gain sqrt(2)); returns the trunk."""
    layers: list[nn.Module] = []
    for width in hidden_sizes:
        linear = nn.Linear(in_features, width)
        nn.init.orthogonal_(linear.weight, gain=2**0.5)
        nn.init.zeros_(linear.bias)
        layers += [linear, activation()]
        in_features = width
    return nn.Sequential(*layers)


class MLPAgent(Agent):
    """Stateless actor-critic: ``observation -> MLP -> action head`` and ``-> MLP -> value``."""

    def __init__(self, observation_space, action_space, hidden_sizes: Sequence[int] = (64, 64)):
        super().__init__(observation_space, action_space)
        hidden_sizes = list(hidden_sizes)
        last = hidden_sizes[-1] if hidden_sizes else self.obs_dim
        self.actor = mlp(self.obs_dim, hidden_sizes)
        self.critic = mlp(self.obs_dim, hidden_sizes)
        self.head = ActionHead(action_space, last)
        self.value = value_head(last)

    def forward(self, observation: torch.Tensor, state: TensorDict, is_first: torch.Tensor) -> TensorDict:
        x = self.flatten_observation(observation)  # (k, N, obs_dim)
        return self.output(dist=self.head(self.actor(x)), value=self.value(self.critic(x)).squeeze(-1), state=state)
