"""Small policies shared by the engine tests (single-process and spawned FSDP workers)."""

from __future__ import annotations

import torch
import torch.nn as nn
from tensordict import TensorDict

from rl_replay import replay


class MLPPolicy(nn.Module):
    """Independent blocks: (logits, value) from the observation only."""

    def __init__(self, obs: int = 6, hidden: int = 16, actions: int = 3) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(obs, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.pi = nn.Linear(hidden, actions)
        self.v = nn.Linear(hidden, 1)
        self.calls = 0

    def forward(self, observation):
        self.calls += 1
        z = self.body(observation)
        return self.pi(z), self.v(z).squeeze(-1)


class GRUPolicy(nn.Module):
    """Recurrent blocks: the hidden state flows from block to block."""

    def __init__(self, obs: int = 5, hidden: int = 12, actions: int = 3, dropout: float = 0.0) -> None:
        super().__init__()
        self.enc = nn.Linear(obs, hidden)
        self.drop = nn.Dropout(dropout)
        self.cell = nn.GRUCell(hidden, hidden)
        self.head = nn.Linear(hidden, actions + 1)
        self.calls = 0

    def forward(self, observation, h):
        self.calls += 1
        x = self.drop(torch.relu(self.enc(observation)))
        h = self.cell(x, h)
        out = self.head(h)
        return out[..., :-1], out[..., -1], h

    def pick(self, h, index):
        """Logit of action ``index`` per row (an integer tensor input)."""
        return self.head(h).gather(-1, index.unsqueeze(-1)).squeeze(-1)


def step_loss(logits, value):
    return logits.logsumexp(-1).mean() + 0.5 * value.square().mean()


class LinearPolicy(nn.Module):
    """One linear layer called with keyword inputs (extra keywords are ignored)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, observation=None, **kwargs):
        return self.lin(observation)


def gru_loss(model, obs, h0, acc=None):
    """A GRUPolicy stepped over ``obs`` (plain autograd, or replay blocks into ``acc``); the
    summed step losses plus the final state's square."""
    h, loss = h0, 0.0
    for t in range(obs.shape[0]):
        if acc is None:
            logits, value, h = model(observation=obs[t], h=h)
        else:
            logits, value, h = replay(model, acc, TensorDict(observation=obs[t], h=h))
        loss = loss + step_loss(logits, value)
    return loss + h.square().sum()


# ------------------------------------------------------------------ FSDP1 parity
