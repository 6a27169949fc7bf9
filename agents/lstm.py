"""A recurrent actor-critic with an LSTM cell: state ``{"h", "c"}`` flows block to block."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import nn

from rl_replay.agents.chrono import check_t_max, chrono_bias
from rl_replay.agents.gru import activation_class, add_heads
from rl_replay.agents.mlp import mlp
from rl_replay.agent import Agent


class LSTMAgent(Agent):
    """Encoder -> LSTMCell -> actor and critic heads (CleanRL's ``ppo_atari_lstm`` layout).

    Both ``h`` and ``c`` are zeroed inside forward where ``is_first`` is set. The forget
    gate's bias starts at ``forget_bias`` (1.0, the usual choice) so the cell keeps its
    memory by default.

    Args:
        forget_bias: one constant forget-gate bias.
        chrono_t_max: instead, chrono initialisation (Tallec & Ollivier 2018, see
            :mod:`rl_replay.agents.chrono`): forget bias ``log(U[1, chrono_t_max - 1])`` per unit and
            input-gate bias its negative, so memory times spread over ``[2, chrono_t_max]``
            and the cell does not fill its memory with every input.
        separate_critic: the value comes from a second encoder and LSTM (sb3-contrib's
            ``enable_critic_lstm``) whose state ``state["h_critic"]``, ``state["c_critic"]``
            flows alongside.
        head_sizes: hidden layers between the LSTM and each of the actor and critic outputs
            (sb3's ``net_arch`` after the LSTM); empty: the outputs read ``h`` directly.
        activation: ``"tanh"`` or ``"relu"``, for the encoder and the head layers.
        skip: the actor and critic read the encoded observation next to ``h`` (see
            :class:`rl_replay.agents.gru.GRUAgent`).
    """

    def __init__(self, observation_space, action_space, hidden_size: int = 128, encoder_sizes=(128,),
                 forget_bias: float = 1.0, chrono_t_max: float | None = None,
                 separate_critic: bool = False, head_sizes=(), activation: str = "tanh",
                 skip: bool = False):
        super().__init__(observation_space, action_space)
        self.activation = activation_class(activation, "LSTMAgent")
        self.hidden_size = hidden_size
        self.separate_critic = separate_critic
        self.skip = skip
        encoder_sizes = list(encoder_sizes)
        features = (encoder_sizes[-1] if encoder_sizes else self.obs_dim) if skip else 0
        self.encoder, self.cell = self._trunk(encoder_sizes, forget_bias, chrono_t_max)
        if separate_critic:
            self.critic_encoder, self.critic_cell = self._trunk(encoder_sizes, forget_bias, chrono_t_max)
        add_heads(self, action_space, hidden_size + features, head_sizes, self.activation)

    def _trunk(self, encoder_sizes, forget_bias: float,
               chrono_t_max: float | None) -> tuple[nn.Module, nn.LSTMCell]:
        H = self.hidden_size
        encoder = mlp(self.obs_dim, encoder_sizes, self.activation)
        cell = nn.LSTMCell(encoder_sizes[-1] if encoder_sizes else self.obs_dim, H)
        with torch.no_grad():  # gates are ordered (input, forget, cell, output)
            cell.bias_ih[H : 2 * H].fill_(forget_bias)
            cell.bias_hh[H : 2 * H].zero_()
            if chrono_t_max is not None:
                forget = chrono_bias(H, check_t_max(chrono_t_max, "LSTMAgent"))
                cell.bias_ih[H : 2 * H].copy_(forget)
                cell.bias_ih[:H].copy_(-forget)
                cell.bias_hh[:H].zero_()
        return encoder, cell

    def initial_state(self, batch_size: int, device="cpu") -> TensorDict:
        zeros = torch.zeros(batch_size, self.hidden_size, device=device)
        state = {"h": zeros, "c": zeros.clone()}
        if self.separate_critic:
            state.update(h_critic=zeros.clone(), c_critic=zeros.clone())
        return TensorDict(state, batch_size=[batch_size])

    def forward(self, observation: torch.Tensor, state: TensorDict, is_first: torch.Tensor) -> TensorDict:
        x = self.flatten_observation(observation)
        h = self.reset_state(state["h"], is_first)  # (N, H)
        c = self.reset_state(state["c"], is_first)  # (N, H)
        e = self.encoder(x)
        h, c = self.cell(e, (h, c))
        next_state = {"h": h, "c": c}
        actor_in = torch.cat([h, e], dim=-1) if self.skip else h
        if self.separate_critic:
            hc = self.reset_state(state["h_critic"], is_first)
            cc = self.reset_state(state["c_critic"], is_first)
            ec = self.critic_encoder(x)
            hc, cc = self.critic_cell(ec, (hc, cc))
            next_state.update(h_critic=hc, c_critic=cc)
            critic_in = torch.cat([hc, ec], dim=-1) if self.skip else hc
        else:
            critic_in = actor_in
        return TensorDict(
            dist=self.head(self.actor_mlp(actor_in)),
            value=self.value(self.critic_mlp(critic_in)).squeeze(-1),
            state=TensorDict(next_state, batch_size=h.shape[:1]),
            batch_size=h.shape[:1],
        )
