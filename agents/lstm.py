"""A recurrent actor-critic with an LSTM core: state ``{"h", "c"}`` flows block to block."""

from __future__ import annotations

import functools

from rl_replay.agents.cores import LSTMCore
from rl_replay.agents.recurrent import RecurrentAgent


class LSTMAgent(RecurrentAgent):
    """Encoder -> LSTM core -> actor and critic heads (CleanRL's ``ppo_atari_lstm`` layout).

    Both ``h`` and ``c`` are zeroed where ``is_first`` is set. The forget gate's bias starts
    at ``forget_bias`` (1.0, the usual choice) so the core keeps its memory by default.

    Args:
        forget_bias: one constant forget-gate bias.
        chrono_t_max: instead, chrono initialisation (Tallec & Ollivier 2018, see
            :mod:`rl_replay.agents.chrono`): forget bias ``log(U[1, chrono_t_max - 1])`` per unit and
            input-gate bias its negative, so memory times spread over ``[2, chrono_t_max]``
            and the core does not fill its memory with every input.
        **skeleton: the skeleton's settings (``encoder``, ``encoder_kwargs``, ``activation``,
            ``skip``, ``readout_sizes``, ``head_sizes``, ``separate_critic``), see
            :class:`~rl_replay.agents.recurrent.RecurrentAgent`; the critic's own LSTM keeps
            its state in ``state["h_critic"]``, ``state["c_critic"]``.
    """

    def __init__(
        self,
        observation_space,
        action_space,
        hidden_size: int = 128,
        encoder_sizes=(128,),
        forget_bias: float = 1.0,
        chrono_t_max: float | None = None,
        **skeleton,
    ):
        super().__init__(
            observation_space,
            action_space,
            make_core=functools.partial(
                LSTMCore, hidden_size=hidden_size, forget_bias=forget_bias, chrono_t_max=chrono_t_max
            ),
            encoder_sizes=encoder_sizes,
            **skeleton,
        )
