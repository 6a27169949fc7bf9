"""A memory transformer actor-critic: encoder -> windowed attention core -> readout -> heads.

The core (:mod:`rl_replay.agents.attention`) keeps each layer's last ``window`` inputs as
recurrent state, so a step attends over its recent past while replay carries the gradient through
those windows across the whole episode. With ``recurrence: lru`` (or ``gru``) a recurrence runs
under the attention and carries memory older than the window.
"""

from __future__ import annotations

import functools

from rl_replay.agents.attention import RecurrentWindowCore, WindowAttentionCore
from rl_replay.agents.recurrent import RecurrentAgent


class WindowTransformerAgent(RecurrentAgent):
    """Encoder (MLP or CNN) -> gated windowed transformer (GTrXL manner) -> heads; short name ``gtrxl``.

    Args:
        d_model: width of the attention layers.
        num_layers: attention layers, each with its own window of past inputs.
        num_heads: attention heads; must divide ``d_model``.
        window: past steps each layer attends over.
        ff_mult: feed-forward width as a multiple of ``d_model``.
        gate_bias: the gates' initial bias towards the identity.
        recurrence: ``None`` (attention only: recall is bounded by ``num_layers * window`` steps),
            ``"lru"`` or ``"gru"`` (that recurrence first; memory beyond the window).
        recurrent_size: the recurrence's state width.
        recurrent_kwargs: further arguments of the recurrence's core (e.g. ``r_max`` of the LRU).
        encoder_sizes: MLP widths before the core.
        **skeleton: the skeleton's other settings (``encoder``, ``encoder_kwargs``, ``activation``,
            ``skip``, ``readout_sizes``, ``head_sizes``, ``separate_critic``), see
            :class:`~rl_replay.agents.recurrent.RecurrentAgent`.

    State: ``memory`` ``(N, num_layers, window, d_model)`` and ``valid`` ``(N, window)``, plus the
    recurrence's (``x`` / ``x_im`` or ``h``).
    """

    def __init__(
        self,
        observation_space,
        action_space,
        d_model: int = 128,
        num_layers: int = 2,
        num_heads: int = 4,
        window: int = 64,
        ff_mult: int = 4,
        gate_bias: float = 2.0,
        recurrence: str | None = None,
        recurrent_size: int = 128,
        recurrent_kwargs: dict | None = None,
        encoder_sizes=(128,),
        **skeleton,
    ):
        attention = dict(
            d_model=d_model,
            num_layers=num_layers,
            num_heads=num_heads,
            window=window,
            ff_mult=ff_mult,
            gate_bias=gate_bias,
            owner=type(self).__name__,
        )
        if recurrence is None:
            make_core = functools.partial(WindowAttentionCore, **attention)
        else:
            make_core = functools.partial(
                RecurrentWindowCore,
                recurrence=recurrence,
                recurrent_size=recurrent_size,
                recurrent_kwargs=recurrent_kwargs,
                **attention,
            )
        super().__init__(observation_space, action_space, make_core=make_core, encoder_sizes=encoder_sizes, **skeleton)
