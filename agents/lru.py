"""A linear recurrent unit (LRU, Orvieto et al., "Resurrecting recurrent neural networks for
long sequences", ICML 2023) as an actor-critic: encoder -> diagonal linear recurrence ->
nonlinear readout -> actor and critic heads.

The recurrence is ``x_t = lambda * x_{t-1} + gamma * (B u_t)`` with a diagonal ``lambda``
(complex, or real when ``max_phase == 0``). Nothing nonlinear sits between ``x_{t-1}`` and
``x_t``, so the gradient from step ``t`` to step ``t - k`` is exactly ``lambda ** k`` per
unit: with ``|lambda|`` drawn close to 1 it neither vanishes nor explodes over thousands of
steps, and it does not depend on what the core saw in between.
"""

from __future__ import annotations

import functools
import math

import torch

from rl_replay.agents.cores import LRUCore
from rl_replay.agents.recurrent import RecurrentAgent


class LRUAgent(RecurrentAgent):
    """Encoder (MLP or CNN) -> LRU core (state ``x``, plus ``x_im`` if complex) -> MLP readout -> heads.

    Args:
        hidden_size: number of diagonal recurrent units (complex units when complex).
        encoder_sizes: MLP widths before the recurrence (tanh); the last is its input ``u``.
        readout_sizes: MLP widths after the recurrence; its input is
            ``y = Re(C x) + D * u`` (width of ``u``).
        r_min, r_max: ring initialisation: ``|lambda|**2`` is uniform in
            ``[r_min**2, r_max**2]``. The memory time of a unit is about ``1 / (1 - |lambda|)``
            steps, so ``r_max = 1 - 1/T`` keeps the slowest units for ``T`` steps.
        max_phase: the phases ``arg(lambda)`` are uniform in ``[0, max_phase]``; 0 gives a
            real diagonal recurrence (half the state, no rotation).
        normalize: scale the input by ``gamma = sqrt(1 - |lambda|**2)`` (learned, initialised
            so), which keeps ``E|x|^2`` at the input's for white-noise input. Without it a
            unit with ``|lambda|`` near 1 integrates its inputs into a large state.
        input_scale: multiplies the initial ``B``. At 1 a random ``B`` writes every input
            into the state from the start (a reservoir the readout can learn to read without
            any gradient reaching the write); at 0 nothing is written until ``B`` is learned,
            so remembering an early observation needs gradient that reaches it.
        **skeleton: the skeleton's other settings (``encoder``, ``encoder_kwargs``,
            ``activation``, ``skip``, ``head_sizes``, ``separate_critic``), see
            :class:`~rl_replay.agents.recurrent.RecurrentAgent`.

    ``encoder_sizes=()`` feeds the observation itself to ``B`` (no bias before the
    recurrence): a zero observation writes nothing, so units with ``|lambda|`` near 1 do not
    integrate a learned constant over a long delay (docs/learning.md, fifth study).

    ``lambda = exp(-exp(nu_log) + i exp(theta_log))``: the exponential parameterisation
    keeps ``|lambda| < 1`` whatever the optimizer does, so the recurrence stays stable. The
    recurrence's parameters live in ``self.core`` (:class:`~rl_replay.agents.cores.LRUCore`).
    """

    def __init__(
        self,
        observation_space,
        action_space,
        hidden_size: int = 128,
        encoder_sizes=(64,),
        readout_sizes=(128,),
        r_min: float = 0.9,
        r_max: float = 0.999,
        max_phase: float = math.pi / 10,
        normalize: bool = True,
        input_scale: float = 1.0,
        **skeleton,
    ):
        super().__init__(
            observation_space,
            action_space,
            make_core=functools.partial(
                LRUCore,
                hidden_size=hidden_size,
                r_min=r_min,
                r_max=r_max,
                max_phase=max_phase,
                normalize=normalize,
                input_scale=input_scale,
            ),
            encoder_sizes=encoder_sizes,
            readout_sizes=readout_sizes,
            **skeleton,
        )

    def eigenvalues(self) -> torch.Tensor:
        """The diagonal ``lambda`` as a complex tensor ``(hidden_size,)``."""
        return self.core.eigenvalues()
