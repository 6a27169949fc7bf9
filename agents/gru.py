"""A recurrent actor-critic: encoder -> GRUCell -> actor and critic heads."""

from __future__ import annotations

import functools

import torch
from torch import nn

from rl_replay.agents.chrono import check_t_max, chrono_bias
from rl_replay.agents.recurrent import RecurrentAgent
from rl_replay.errors import SetupError


def gru_cell(in_features: int, hidden_size: int, update_gate_bias: float, chrono_t_max: float | None) -> nn.GRUCell:
    """A ``GRUCell`` whose update (keep) gate starts at ``update_gate_bias`` or chrono-initialised."""
    H = hidden_size
    cell = nn.GRUCell(in_features, H)
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
    return cell


class GRUAgent(RecurrentAgent):
    """GRU policy whose hidden state ``state["h"]`` flows from block to block.

    The state is zeroed inside forward where ``is_first`` is set, so a rollout that
    crosses an episode boundary carries no gradient from one episode into the next.

    Args:
        update_gate_bias: one constant bias for the update (keep) gate; 0 leaves torch's init.
        chrono_t_max: instead, chrono initialisation (see :mod:`rl_replay.agents.chrono`): the update
            gate's bias per unit is ``log(U[1, chrono_t_max - 1])``, so the units' memory
            times spread over ``[2, chrono_t_max]`` steps. Set it to the longest delay.
        separate_critic, head_sizes, activation, skip, encoder, encoder_kwargs: see
            :class:`~rl_replay.agents.recurrent.RecurrentAgent`; the critic's own GRU keeps
            its state in ``state["h_critic"]``.
    """

    state_keys = ("h",)

    def __init__(
        self,
        observation_space,
        action_space,
        hidden_size: int = 128,
        encoder_sizes=(128,),
        update_gate_bias: float = 0.0,
        chrono_t_max: float | None = None,
        separate_critic: bool = False,
        head_sizes=(),
        activation: str = "tanh",
        skip: bool = False,
        encoder: str = "mlp",
        encoder_kwargs: dict | None = None,
    ):
        if chrono_t_max is not None and update_gate_bias:
            raise SetupError("GRUAgent: set update_gate_bias or chrono_t_max, not both.")
        super().__init__(
            observation_space,
            action_space,
            hidden_size=hidden_size,
            encoder_sizes=encoder_sizes,
            separate_critic=separate_critic,
            head_sizes=head_sizes,
            activation=activation,
            skip=skip,
            encoder=encoder,
            encoder_kwargs=encoder_kwargs,
            make_cell=functools.partial(gru_cell, update_gate_bias=update_gate_bias, chrono_t_max=chrono_t_max),
        )

    def cell_step(self, cell, inputs, state):
        return (cell(inputs, state[0]),)
