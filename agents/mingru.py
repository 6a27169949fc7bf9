"""minGRU (Feng et al., "Were RNNs all we needed?", 2024) as an actor-critic: a gated cell
whose gate and candidate depend on the input only, so the state update is linear in the
state: ``h_t = (1 - z_t) * h_{t-1} + z_t * h~_t``.

The gradient from ``h_t`` to ``h_{t-k}`` is the product of the keep gates ``1 - z`` over
those steps, elementwise, with no recurrent weight matrix to shrink or blow it up. The
update gate's bias gets a chrono initialisation (:mod:`rl_replay.agents.chrono`), so the units'
memory times spread over ``[2, chrono_t_max]`` steps.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import nn

from rl_replay.agent import ActionHead, Agent, value_head
from rl_replay.agents.chrono import check_t_max, chrono_bias
from rl_replay.agents.mlp import mlp
from rl_replay.errors import SetupError


class MinGRUAgent(Agent):
    """Encoder MLP -> minGRU (state ``h``) -> MLP readout of ``[h, u]`` -> heads.

    Args:
        hidden_size: recurrent units.
        encoder_sizes: MLP widths before the cell (tanh); the last is the cell's input ``u``.
        readout_sizes: MLP widths after the cell; its input is ``h`` next to ``u``, so the
            current observation reaches the heads without going through the slow memory.
        chrono_t_max: the longest memory time (steps) the gate bias is initialised for.
    """

    def __init__(
        self,
        observation_space,
        action_space,
        hidden_size: int = 128,
        encoder_sizes=(64,),
        readout_sizes=(128,),
        chrono_t_max: float = 1024,
    ):
        super().__init__(observation_space, action_space)
        if not (isinstance(hidden_size, int) and hidden_size > 0):
            raise SetupError(f"MinGRUAgent: hidden_size must be a positive integer, got {hidden_size!r}.")
        encoder_sizes, readout_sizes = list(encoder_sizes), list(readout_sizes)
        self.hidden_size = hidden_size
        self.encoder = mlp(self.obs_dim, encoder_sizes)
        width = encoder_sizes[-1] if encoder_sizes else self.obs_dim
        self.gate = nn.Linear(width, hidden_size)
        self.candidate = nn.Linear(width, hidden_size)
        with torch.no_grad():
            # z = sigmoid(b) is the write gate; 1 - z = sigmoid(-b) keeps, so -b gets the chrono bias.
            self.gate.bias.copy_(-chrono_bias(hidden_size, check_t_max(chrono_t_max, "MinGRUAgent")))
        self.readout = mlp(hidden_size + width, readout_sizes)
        features = readout_sizes[-1] if readout_sizes else hidden_size + width
        self.head = ActionHead(action_space, features)
        self.value = value_head(features)

    def initial_state(self, batch_size: int, device="cpu") -> TensorDict:
        return TensorDict(h=torch.zeros(batch_size, self.hidden_size, device=device), batch_size=[batch_size])

    def forward(self, observation: torch.Tensor, state: TensorDict, is_first: torch.Tensor) -> TensorDict:
        u = self.encoder(observation.flatten(1))  # (N, width)
        h = self.reset_state(state["h"], is_first)  # (N, H)
        z = torch.sigmoid(self.gate(u))
        h = torch.lerp(h, self.candidate(u), z)  # (1 - z) * h + z * h~
        features = self.readout(torch.cat([h, u], dim=-1))
        return TensorDict(
            dist=self.head(features),
            value=self.value(features).squeeze(-1),
            state=TensorDict(h=h, batch_size=h.shape[:1]),
            batch_size=h.shape[:1],
        )
