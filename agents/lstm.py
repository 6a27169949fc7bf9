"""A recurrent actor-critic with an LSTM cell: state ``{"h", "c"}`` flows block to block."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import nn

from agents.chrono import check_t_max, chrono_bias
from agents.mlp import mlp
from rl_replay.agent import ActionHead, Agent, value_head


class LSTMAgent(Agent):
    """Encoder -> LSTMCell -> actor and critic heads (CleanRL's ``ppo_atari_lstm`` layout).

    Both ``h`` and ``c`` are zeroed inside forward where ``is_first`` is set. The forget
    gate's bias starts at ``forget_bias`` (1.0, the usual choice) so the cell keeps its
    memory by default.

    Args:
        forget_bias: one constant forget-gate bias.
        chrono_t_max: instead, chrono initialisation (Tallec & Ollivier 2018, see
            :mod:`agents.chrono`): forget bias ``log(U[1, chrono_t_max - 1])`` per unit and
            input-gate bias its negative, so memory times spread over ``[2, chrono_t_max]``
            and the cell does not fill its memory with every input.
    """

    def __init__(self, observation_space, action_space, hidden_size: int = 128, encoder_sizes=(128,),
                 forget_bias: float = 1.0, chrono_t_max: float | None = None):
        super().__init__(observation_space, action_space)
        encoder_sizes = list(encoder_sizes)
        self.hidden_size = hidden_size
        self.encoder = mlp(self.obs_dim, encoder_sizes)
        self.cell = nn.LSTMCell(encoder_sizes[-1] if encoder_sizes else self.obs_dim, hidden_size)
        with torch.no_grad():  # gates are ordered (input, forget, cell, output)
            self.cell.bias_ih[hidden_size : 2 * hidden_size].fill_(forget_bias)
            self.cell.bias_hh[hidden_size : 2 * hidden_size].zero_()
            if chrono_t_max is not None:
                forget = chrono_bias(hidden_size, check_t_max(chrono_t_max, "LSTMAgent"))
                self.cell.bias_ih[hidden_size : 2 * hidden_size].copy_(forget)
                self.cell.bias_ih[:hidden_size].copy_(-forget)
                self.cell.bias_hh[:hidden_size].zero_()
        self.head = ActionHead(action_space, hidden_size)
        self.value = value_head(hidden_size)

    def initial_state(self, batch_size: int, device="cpu") -> TensorDict:
        zeros = torch.zeros(batch_size, self.hidden_size, device=device)
        return TensorDict(h=zeros, c=zeros.clone(), batch_size=[batch_size])

    def forward(self, observation: torch.Tensor, state: TensorDict, is_first: torch.Tensor) -> TensorDict:
        h = self.reset_state(state["h"], is_first)  # (N, H)
        c = self.reset_state(state["c"], is_first)  # (N, H)
        h, c = self.cell(self.encoder(self.flatten_observation(observation)), (h, c))
        return TensorDict(
            dist=self.head(h),
            value=self.value(h).squeeze(-1),
            state=TensorDict(h=h, c=c, batch_size=h.shape[:1]),
            batch_size=h.shape[:1],
        )
