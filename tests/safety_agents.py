"""Agents that break the Agent contract (tests/agents/test_contract_errors.py) and a deliberately slow one.

Loaded through ``agent.target=safety_agents:<Name>`` with tests/ on the path.
"""

from __future__ import annotations

import time

import torch
from tensordict import TensorDict
from torch import nn

from rl_replay.agent import ActionHead, Agent


class _Base(Agent):
    def __init__(self, observation_space, action_space, hidden: int = 8):
        super().__init__(observation_space, action_space)
        self.body = nn.Sequential(nn.Linear(self.obs_dim, hidden), nn.Tanh())
        self.head = ActionHead(action_space, hidden)
        self.critic = nn.Linear(hidden, 1)

    def forward(self, observation, state, is_first):
        x = self.body(self.flatten_observation(observation).flatten(0, 1)).unflatten(0, is_first.shape)
        return self.output(dist=self.head(x), value=self.critic(x).squeeze(-1), state=state)


class WrongKeyAgent(_Base):
    """Returns its distribution parameters under 'distribution' instead of 'dist'."""

    def forward(self, observation, state, is_first):
        out = super().forward(observation, state, is_first)
        out["outputs", "distribution"] = out["outputs"].pop("dist")
        return out


class ColumnValueAgent(_Base):
    """Returns value of shape (k, N, 1) (forgot the squeeze)."""

    def forward(self, observation, state, is_first):
        out = super().forward(observation, state, is_first)
        out["outputs", "value"] = out["outputs", "value"].unsqueeze(-1)
        return out


class WideLogitsAgent(_Base):
    """Three logits for CartPole's two actions."""

    def __init__(self, observation_space, action_space, hidden: int = 8, extra: int = 1):
        super().__init__(observation_space, action_space, hidden)
        self.head.linear = nn.Linear(hidden, int(action_space.n) + extra)


class NarrowLogitsAgent(WideLogitsAgent):
    """One logit for CartPole's two actions."""

    def __init__(self, observation_space, action_space, hidden: int = 8):
        super().__init__(observation_space, action_space, hidden, extra=-1)


class BatchNormAgent(_Base):
    """BatchNorm in training mode: its running statistics change on every forward."""

    def __init__(self, observation_space, action_space, hidden: int = 8):
        super().__init__(observation_space, action_space, hidden)
        self.body = nn.Sequential(nn.Linear(self.obs_dim, hidden), nn.BatchNorm1d(hidden), nn.Tanh())


class SlowAgent(_Base):
    """Sleeps in every forward, so an update takes long enough to signal it twice."""

    def forward(self, observation, state, is_first):
        time.sleep(0.05)
        return super().forward(observation, state, is_first)


class _GRUBase(_Base):
    """A GRU agent whose state is ``h`` of width ``hidden`` (initial_state zeros); ``resets``:
    whether it zeroes ``h`` where an episode starts."""

    resets = True

    def __init__(self, observation_space, action_space, hidden: int = 8):
        super().__init__(observation_space, action_space, hidden)
        self.hidden = hidden
        self.cell = nn.GRUCell(hidden, hidden)

    def initial_state(self, batch_size, device="cpu"):
        return TensorDict(h=torch.zeros(batch_size, self.hidden, device=device), batch_size=[batch_size])

    def forward(self, observation, state, is_first):
        x = self.body(self.flatten_observation(observation))  # (k, N, hidden)
        h, rows = state["h"], []
        for t in range(is_first.shape[0]):
            h = self.cell(x[t], self.reset_state(h, is_first[t]) if self.resets else h)
            rows.append(h)
        hs = torch.stack(rows)
        state = TensorDict(h=h, batch_size=h.shape[:1])
        return self.output(dist=self.head(hs), value=self.critic(hs).squeeze(-1), state=state)


class ResetGRUAgent(_GRUBase):
    """Conforming: resets h where an episode starts."""


class NoResetAgent(_GRUBase):
    """Never resets its state at is_first: memory crosses episode boundaries."""

    resets = False


class WideStateAgent(ResetGRUAgent):
    """Returns a state twice as wide as initial_state (the replay's cell then gets the wrong width)."""

    def forward(self, observation, state, is_first):
        out = super().forward(observation, state, is_first)
        out["state"] = TensorDict(h=out["state", "h"].repeat(1, 2), batch_size=out["state"].batch_size)
        return out


class DistributionObjectAgent(_Base):
    """Returns a torch.distributions object under 'dist' instead of its parameters."""

    def forward(self, observation, state, is_first):
        out = super().forward(observation, state, is_first)
        out["outputs", "dist"] = torch.distributions.Categorical(logits=out["outputs", "dist", "logits"])
        return out

    def distribution(self, outputs):
        return outputs["dist"]
