"""A recurrent actor-critic: encoder -> GRU core -> actor and critic heads."""

from __future__ import annotations

import functools

from rl_replay.agents.cores import GRUCore
from rl_replay.agents.recurrent import RecurrentAgent
from rl_replay.errors import SetupError


class GRUAgent(RecurrentAgent):
    """GRU policy whose hidden state ``state["h"]`` flows from block to block.

    The state is zeroed where ``is_first`` is set, so a rollout that crosses an episode
    boundary carries no gradient from one episode into the next.

    Args:
        update_gate_bias: one constant bias for the update (keep) gate; 0 leaves torch's init.
        chrono_t_max: instead, chrono initialisation (see :mod:`rl_replay.agents.chrono`): the update
            gate's bias per unit is ``log(U[1, chrono_t_max - 1])``, so the units' memory
            times spread over ``[2, chrono_t_max]`` steps. Set it to the longest delay.
        **skeleton: the skeleton's settings (``encoder``, ``encoder_kwargs``, ``activation``,
            ``skip``, ``readout_sizes``, ``head_sizes``, ``separate_critic``), see
            :class:`~rl_replay.agents.recurrent.RecurrentAgent`; the critic's own GRU keeps
            its state in ``state["h_critic"]``.
    """

    def __init__(
        self,
        observation_space,
        action_space,
        hidden_size: int = 128,
        encoder_sizes=(128,),
        update_gate_bias: float = 0.0,
        chrono_t_max: float | None = None,
        **skeleton,
    ):
        if chrono_t_max is not None and update_gate_bias:
            raise SetupError("GRUAgent: set update_gate_bias or chrono_t_max, not both.")
        super().__init__(
            observation_space,
            action_space,
            make_core=functools.partial(
                GRUCore, hidden_size=hidden_size, update_gate_bias=update_gate_bias, chrono_t_max=chrono_t_max
            ),
            encoder_sizes=encoder_sizes,
            **skeleton,
        )
