"""A recurrent actor-critic: encoder -> GRUCell -> actor and critic heads."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import nn

from rl_replay.agents.chrono import check_t_max, chrono_bias
from rl_replay.agents.mlp import mlp
from rl_replay.agent import ActionHead, Agent, value_head
from rl_replay.errors import SetupError

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU}


def activation_class(name: str, agent_name: str) -> type[nn.Module]:
    """The module class for ``name`` ("tanh" or "relu"); SetupError otherwise."""
    if name not in ACTIVATIONS:
        raise SetupError(f"{agent_name}: activation must be one of {sorted(ACTIVATIONS)}, got {name!r}.")
    return ACTIVATIONS[name]


def add_heads(agent: Agent, action_space, in_features: int, head_sizes, activation) -> None:
    """Give a recurrent agent its ``actor_mlp`` / ``critic_mlp`` (``head_sizes`` wide) and
    the ``head`` / ``value`` outputs on top, all reading ``in_features``."""
    head_sizes = list(head_sizes)
    last = head_sizes[-1] if head_sizes else in_features
    agent.actor_mlp = mlp(in_features, head_sizes, activation)
    agent.critic_mlp = mlp(in_features, head_sizes, activation)
    agent.head = ActionHead(action_space, last)
    agent.value = value_head(last)


class GRUAgent(Agent):
    """GRU policy whose hidden state ``state["h"]`` flows from block to block.

    The state is zeroed inside forward where ``is_first`` is set, so a rollout that
    crosses an episode boundary carries no gradient from one episode into the next.

    Args:
        update_gate_bias: one constant bias for the update (keep) gate; 0 leaves torch's init.
        chrono_t_max: instead, chrono initialisation (see :mod:`rl_replay.agents.chrono`): the update
            gate's bias per unit is ``log(U[1, chrono_t_max - 1])``, so the units' memory
            times spread over ``[2, chrono_t_max]`` steps. Set it to the longest delay.
        separate_critic: the value comes from a second encoder and GRU (sb3-contrib's
            ``enable_critic_lstm``) whose state ``state["h_critic"]`` flows alongside.
        head_sizes: hidden layers between the GRU and each of the actor and critic outputs
            (sb3's ``net_arch`` after the LSTM); empty: the outputs read the GRU state directly.
        activation: ``"tanh"`` or ``"relu"``, for the encoder and the head layers.
        skip: the actor and critic read the encoded observation next to the GRU state. The
            GRU's state is a leaky average of past inputs (its update gate starts near 0.5),
            so without the skip a reactive task sees the present only through that lag;
            with it the state only has to carry what the present observation lacks.
    """

    def __init__(self, observation_space, action_space, hidden_size: int = 128, encoder_sizes=(128,),
                 update_gate_bias: float = 0.0, chrono_t_max: float | None = None,
                 separate_critic: bool = False, head_sizes=(), activation: str = "tanh",
                 skip: bool = False):
        super().__init__(observation_space, action_space)
        self.activation = activation_class(activation, "GRUAgent")
        if chrono_t_max is not None and update_gate_bias:
            raise SetupError("GRUAgent: set update_gate_bias or chrono_t_max, not both.")
        self.hidden_size = hidden_size
        self.separate_critic = separate_critic
        self.skip = skip
        encoder_sizes = list(encoder_sizes)
        features = (encoder_sizes[-1] if encoder_sizes else self.obs_dim) if skip else 0
        self.encoder, self.cell = self._trunk(encoder_sizes, update_gate_bias, chrono_t_max)
        if separate_critic:
            # The critic's own encoder and GRU: the value loss, large while returns are
            # unnormalised, then cannot drown the policy's gradient in a shared trunk.
            self.critic_encoder, self.critic_cell = self._trunk(encoder_sizes, update_gate_bias, chrono_t_max)
        add_heads(self, action_space, hidden_size + features, head_sizes, self.activation)

    def _trunk(self, encoder_sizes, update_gate_bias: float,
               chrono_t_max: float | None) -> tuple[nn.Module, nn.GRUCell]:
        H = self.hidden_size
        encoder = mlp(self.obs_dim, encoder_sizes, self.activation)
        cell = nn.GRUCell(encoder_sizes[-1] if encoder_sizes else self.obs_dim, H)
        if chrono_t_max is not None:
            t_max = check_t_max(chrono_t_max, "GRUAgent")
            with torch.no_grad():  # z = sigmoid(b_iz + b_hz + ...) is the keep gate in torch
                cell.bias_ih[H : 2 * H].copy_(chrono_bias(H, t_max))
                cell.bias_hh[H : 2 * H].zero_()
        elif update_gate_bias:
            # GRUCell gates are ordered (reset, update, new); a positive update-gate bias makes
            # the cell keep its state by default, so gradient survives long delays (the GRU
            # analogue of an LSTM forget-gate bias of 1).
            with torch.no_grad():
                cell.bias_hh[H : 2 * H].fill_(update_gate_bias)
        return encoder, cell

    def initial_state(self, batch_size: int, device="cpu") -> TensorDict:
        h = torch.zeros(batch_size, self.hidden_size, device=device)
        if self.separate_critic:
            return TensorDict(h=h, h_critic=h.clone(), batch_size=[batch_size])
        return TensorDict(h=h, batch_size=[batch_size])

    def forward(self, observation: torch.Tensor, state: TensorDict, is_first: torch.Tensor) -> TensorDict:
        x = self.flatten_observation(observation)
        h = self.reset_state(state["h"], is_first)  # (N, H)
        e = self.encoder(x)
        h = self.cell(e, h)
        next_state = {"h": h}
        actor_in = torch.cat([h, e], dim=-1) if self.skip else h
        if self.separate_critic:
            hc = self.reset_state(state["h_critic"], is_first)  # (N, H)
            ec = self.critic_encoder(x)
            hc = next_state["h_critic"] = self.critic_cell(ec, hc)
            critic_in = torch.cat([hc, ec], dim=-1) if self.skip else hc
        else:
            critic_in = actor_in
        return TensorDict(
            dist=self.head(self.actor_mlp(actor_in)),
            value=self.value(self.critic_mlp(critic_in)).squeeze(-1),
            state=TensorDict(next_state, batch_size=h.shape[:1]),
            batch_size=h.shape[:1],
        )
