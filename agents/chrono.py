"""Chrono initialisation of gate biases (Tallec & Ollivier, "Can recurrent neural networks
warp time?", ICLR 2018).

A gated cell that keeps a fraction ``sigmoid(b)`` of its state per step forgets with a
characteristic time of about ``1 / (1 - sigmoid(b)) = 1 + exp(b)`` steps. Drawing
``b = log(U[1, T_max - 1])`` per unit spreads those times over ``[2, T_max]``, so some
units hold information (and pass gradient) across the longest delay the task needs while
others stay fast. ``T_max`` is the longest dependency the agent is expected to bridge.
"""

from __future__ import annotations

import torch

from rl_replay.errors import SetupError


def check_t_max(t_max, owner: str) -> float:
    """``t_max`` as a float; SetupError unless it is a number > 2."""
    if isinstance(t_max, bool) or not isinstance(t_max, (int, float)) or not t_max > 2:
        raise SetupError(f"{owner}: chrono_t_max must be a number > 2 (the longest delay in steps), got {t_max!r}.")
    return float(t_max)


def chrono_bias(size: int, t_max: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """``log(U[1, t_max - 1])`` of shape ``(size,)``: keep-gate biases with time scales in [2, t_max]."""
    u = torch.rand(size, generator=generator, dtype=torch.float64) * (t_max - 2.0) + 1.0
    return u.log().float()
