"""The synthetic policies the memory benchmarks measure (``memory.py``).

Each entry of :data:`POLICIES` is a plain dict (JSON-serialisable: it travels to the worker
process in the configuration spec) from which :func:`build_policy` builds the module.
"""

from __future__ import annotations

import torch
from torch import nn

# kind: gru (recurrent: obs -> MLP encoder -> GRUCell -> heads) or mlp (stateless)
POLICIES: dict[str, dict] = {
    "gru": dict(kind="gru", obs=64, width=1024, layers=3, hidden=512, actions=8, batch=32),
    "mlp": dict(kind="mlp", obs=64, width=1024, layers=6, actions=8, batch=64),
    "wide": dict(kind="mlp", obs=256, width=4096, layers=4, actions=8, batch=16),
    "small_gru": dict(kind="gru", obs=32, width=256, layers=1, hidden=256, actions=8, batch=16),
    # --smoke
    "tiny_gru": dict(kind="gru", obs=8, width=32, layers=2, hidden=16, actions=4, batch=4),
    "tiny_mlp": dict(kind="mlp", obs=8, width=32, layers=3, actions=4, batch=4),
}


def encoder(obs: int, width: int, layers: int) -> nn.Sequential:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(obs, width), nn.Tanh()]
        obs = width
    return nn.Sequential(*mods)


class GRUPolicy(nn.Module):
    """obs -> tanh MLP encoder -> GRUCell -> (logits, value, next hidden state)."""

    def __init__(self, obs, width, layers, hidden, actions, **_):
        super().__init__()
        self.encoder = encoder(obs, width, layers)
        self.cell = nn.GRUCell(width, hidden)
        self.actor = nn.Linear(hidden, actions)
        self.critic = nn.Linear(hidden, 1)

    def forward(self, obs, h):
        h = self.cell(self.encoder(obs), h)
        return self.actor(h), self.critic(h).squeeze(-1), h


class MLPPolicy(nn.Module):
    """obs -> deep tanh MLP -> (logits, value); no recurrence."""

    def __init__(self, obs, width, layers, actions, **_):
        super().__init__()
        self.trunk = encoder(obs, width, layers)
        self.actor = nn.Linear(width, actions)
        self.critic = nn.Linear(width, 1)

    def forward(self, obs):
        x = self.trunk(obs)
        return self.actor(x), self.critic(x).squeeze(-1)


def build_policy(cfg: dict, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return GRUPolicy(**cfg) if cfg["kind"] == "gru" else MLPPolicy(**cfg)


def count_params(cfg: dict) -> int:
    with torch.device("meta"):
        m = GRUPolicy(**cfg) if cfg["kind"] == "gru" else MLPPolicy(**cfg)
    return sum(p.numel() for p in m.parameters())
