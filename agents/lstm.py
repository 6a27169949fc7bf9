"""A recurrent actor-critic with an LSTM cell: state ``{"h", "c"}`` flows block to block."""

from __future__ import annotations

import functools

import torch
from torch import nn

from rl_replay.agents.chrono import check_t_max, chrono_bias
from rl_replay.agents.recurrent import RecurrentAgent


def lstm_cell(in_features: int, hidden_size: int, forget_bias: float, chrono_t_max: float | None) -> nn.LSTMCell:
    """An ``LSTMCell`` whose forget gate starts at ``forget_bias``, or chrono-initialised."""
    H = hidden_size
    cell = nn.LSTMCell(in_features, H)
    with torch.no_grad():  # gates are ordered (input, forget, cell, output)
        cell.bias_ih[H : 2 * H].fill_(forget_bias)
        cell.bias_hh[H : 2 * H].zero_()
        if chrono_t_max is not None:
            forget = chrono_bias(H, check_t_max(chrono_t_max, "LSTMAgent"))
            cell.bias_ih[H : 2 * H].copy_(forget)
            cell.bias_ih[:H].copy_(-forget)
            cell.bias_hh[:H].zero_()
    return cell


class LSTMAgent(RecurrentAgent):
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
        separate_critic, head_sizes, activation, skip, encoder, encoder_kwargs: see
            :class:`~rl_replay.agents.recurrent.RecurrentAgent`; the critic's own LSTM keeps
            its state in ``state["h_critic"]``, ``state["c_critic"]``.
    """

    state_keys = ("h", "c")

    def __init__(
        self,
        observation_space,
        action_space,
        hidden_size: int = 128,
        encoder_sizes=(128,),
        forget_bias: float = 1.0,
        chrono_t_max: float | None = None,
        separate_critic: bool = False,
        head_sizes=(),
        activation: str = "tanh",
        skip: bool = False,
        encoder: str = "mlp",
        encoder_kwargs: dict | None = None,
    ):
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
            make_cell=functools.partial(lstm_cell, forget_bias=forget_bias, chrono_t_max=chrono_t_max),
        )

    def cell_step(self, cell, inputs, state):
        return cell(inputs, state)
