"""A recurrent actor-critic: encoder -> GRUCell -> actor and critic heads."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import nn

from agents.mlp import mlp
from rl_replay.agent import ActionHead, Agent, value_head


class GRUAgent(Agent):
    """GRU policy whose hidden state ``state["h"]`` flows from block to block.

    The state is zeroed inside forward where ``is_first`` is set, so a rollout that
    crosses an episode boundary carries no gradient from one episode into the next.
    """

    def __init__(self, observation_space, action_space, hidden_size: int = 128, encoder_sizes=(128,),
                 update_gate_bias: float = 0.0):
        super().__init__(observation_space, action_space)
        encoder_sizes = list(encoder_sizes)
        self.hidden_size = hidden_size
        self.encoder = mlp(self.obs_dim, encoder_sizes)
        self.cell = nn.GRUCell(encoder_sizes[-1] if encoder_sizes else self.obs_dim, hidden_size)
        if update_gate_bias:
            # GRUCell gates are ordered (reset, update, new); a positive update-gate bias makes
            # the cell keep its state by default, so gradient survives long delays (the GRU
            # analogue of an LSTM forget-gate bias of 1).
            with torch.no_grad():
                self.cell.bias_hh[hidden_size : 2 * hidden_size].fill_(update_gate_bias)
        self.head = ActionHead(action_space, hidden_size)
        self.value = value_head(hidden_size)

    def initial_state(self, batch_size: int, device="cpu") -> TensorDict:
        h = torch.zeros(batch_size, self.hidden_size, device=device)
        return TensorDict(h=h, batch_size=[batch_size])

    def forward(self, observation: torch.Tensor, state: TensorDict, is_first: torch.Tensor) -> TensorDict:
        h = self.reset_state(state["h"], is_first)  # (N, H)
        h = self.cell(self.encoder(self.flatten_observation(observation)), h)
        return TensorDict(
            dist=self.head(h),
            value=self.value(h).squeeze(-1),
            state=TensorDict(h=h, batch_size=h.shape[:1]),
            batch_size=h.shape[:1],
        )
