"""minGRU (Feng et al., "Were RNNs all we needed?", 2024) as an actor-critic: a gated core
whose gate and candidate depend on the input only, so the state update is linear in the
state: ``h_t = (1 - z_t) * h_{t-1} + z_t * h~_t``.

The gradient from ``h_t`` to ``h_{t-k}`` is the product of the keep gates ``1 - z`` over
those steps, elementwise, with no recurrent weight matrix to shrink or blow it up. The
update gate's bias gets a chrono initialisation (:mod:`rl_replay.agents.chrono`), so the units'
memory times spread over ``[2, chrono_t_max]`` steps.
"""

from __future__ import annotations

import functools

from rl_replay.agents.cores import MinGRUCore
from rl_replay.agents.recurrent import RecurrentAgent


class MinGRUAgent(RecurrentAgent):
    """Encoder -> minGRU core (state ``h``) -> MLP readout of ``[h, u]`` -> heads.

    Args:
        hidden_size: recurrent units.
        encoder_sizes: MLP widths before the core (tanh); the last is the core's input ``u``.
        readout_sizes: MLP widths after the core; its input is ``h`` next to ``u``, so the
            current observation reaches the heads without going through the slow memory.
        chrono_t_max: the longest memory time (steps) the gate bias is initialised for.
        skip: the readout reads ``u`` next to ``h`` (on by default: see ``readout_sizes``).
        **skeleton: the skeleton's other settings (``encoder``, ``encoder_kwargs``,
            ``activation``, ``head_sizes``, ``separate_critic``), see
            :class:`~rl_replay.agents.recurrent.RecurrentAgent`.
    """

    def __init__(
        self,
        observation_space,
        action_space,
        hidden_size: int = 128,
        encoder_sizes=(64,),
        readout_sizes=(128,),
        chrono_t_max: float = 1024,
        skip: bool = True,
        **skeleton,
    ):
        super().__init__(
            observation_space,
            action_space,
            make_core=functools.partial(MinGRUCore, hidden_size=hidden_size, chrono_t_max=chrono_t_max),
            encoder_sizes=encoder_sizes,
            skip=skip,
            readout_sizes=readout_sizes,
            **skeleton,
        )
