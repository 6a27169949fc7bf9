"""Discounted returns and generalised advantage estimation over ``(T, N)`` rollouts.

Shapes and flags as in :mod:`rl_replay.algorithms.losses`: ``reward``, ``terminated``,
``truncated``, ``valid`` and ``next_value`` are ``(T, N)``; invalid rows contribute nothing.
These run without a graph (targets, not loss terms).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["compute_gae", "discounted_returns", "check_same_shapes"]


def check_same_shapes(named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Raise ValueError unless all tensors are 2-D and share one shape."""
    items = list(named)
    ref_name, ref = items[0]
    if ref.dim() != 2:
        raise ValueError(f"{ref_name!r} must have shape (T, N), got {tuple(ref.shape)}")
    for name, tensor in items[1:]:
        if tensor.shape != ref.shape:
            raise ValueError(
                f"shape mismatch: {name!r} has shape {tuple(tensor.shape)} but "
                f"{ref_name!r} has shape {tuple(ref.shape)}; all entries must be (T, N)"
            )


def _check_discount(name: str, x: float) -> None:
    if not 0.0 <= float(x) <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {x}")


def compute_gae(
    reward: torch.Tensor,
    value: torch.Tensor,
    next_value: torch.Tensor,
    terminated: torch.Tensor,
    truncated: torch.Tensor,
    *,
    gamma: float,
    gae_lambda: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over a (T, N) rollout.

    ``delta_t = r_t + gamma * (1 - terminated_t) * next_value_t - value_t`` and
    ``A_t = delta_t + gamma * lambda * (1 - done_t) * A_{t+1}`` with
    ``done = terminated | truncated`` and ``A_T = 0``: the recursion never
    crosses an episode boundary, a terminated step does not bootstrap and a
    truncated step bootstraps from its ``next_value``. Both masks are applied
    with ``torch.where``, so a NaN ``next_value`` on a terminated step or a NaN
    advantage beyond an episode boundary cannot leak. Computed under
    ``torch.no_grad``; ``value`` is detached here.

    This function knows nothing about ``valid``; the loss functions zero
    invalid rows and mark them done before calling it.

    Args:
        reward: (T, N) float rewards.
        value: (T, N) critic estimates V(s_t) (detached here).
        next_value: (T, N) V of the observation after step t (detached).
        terminated: (T, N) bool, episode terminated at step t.
        truncated: (T, N) bool, episode truncated at step t.
        gamma: discount factor in [0, 1].
        gae_lambda: GAE lambda in [0, 1].

    Returns:
        (advantages, returns): both (T, N), detached; ``returns = advantages + value``.

    Raises:
        ValueError: shapes differ or are not 2-D, or gamma / gae_lambda not in [0, 1].
    """
    check_same_shapes(
        [
            ("reward", reward),
            ("value", value),
            ("next_value", next_value),
            ("terminated", terminated),
            ("truncated", truncated),
        ]
    )
    _check_discount("gamma", gamma)
    _check_discount("gae_lambda", gae_lambda)
    with torch.no_grad():
        dtype = torch.promote_types(reward.dtype, value.dtype)
        reward = reward.to(dtype)  # (T, N)
        value = value.detach().to(dtype)  # (T, N)
        next_value = next_value.detach().to(dtype)  # (T, N)
        terminated = terminated.bool()  # (T, N)
        not_done = ~(terminated | truncated.bool())  # (T, N)

        bootstrap = torch.where(terminated, 0.0, next_value)  # (T, N)
        delta = reward + gamma * bootstrap - value  # (T, N)
        coef = gamma * gae_lambda

        advantages = torch.empty_like(delta)  # (T, N)
        last = torch.zeros_like(delta[0])  # (N,) = A_{t+1}
        for t in range(delta.shape[0] - 1, -1, -1):
            last = delta[t] + coef * torch.where(not_done[t], last, 0.0)  # (N,)
            advantages[t] = last
        returns = advantages + value  # (T, N)
    return advantages, returns


def discounted_returns(
    reward: torch.Tensor,
    next_value: torch.Tensor,
    terminated: torch.Tensor,
    truncated: torch.Tensor,
    *,
    gamma: float,
) -> torch.Tensor:
    """Monte-Carlo discounted return with bootstrap at truncation and the last row.

    ``G_t = r_t + gamma * G_{t+1}`` inside an episode; at a terminated step
    ``G_t = r_t``; at a truncated step, and at the last row when it is not
    terminated, ``G_t = r_t + gamma * next_value_t``. ``next_value`` is read
    only on those rows. Implemented as :func:`compute_gae` with ``lambda = 1``
    and a zero baseline, so for a consistent rollout (``next_value_t ==
    value_{t+1}`` inside episodes) it equals ``compute_gae(..., gae_lambda=1)[1]``.

    Args:
        reward: (T, N) float rewards.
        next_value: (T, N) V of the observation after step t (detached).
        terminated: (T, N) bool, episode terminated at step t.
        truncated: (T, N) bool, episode truncated at step t.
        gamma: discount factor in [0, 1].

    Returns:
        (T, N) detached discounted returns.

    Raises:
        ValueError: shapes differ or are not 2-D, or gamma not in [0, 1].
    """
    check_same_shapes(
        [
            ("reward", reward),
            ("next_value", next_value),
            ("terminated", terminated),
            ("truncated", truncated),
        ]
    )
    with torch.no_grad():
        last_row = torch.zeros_like(truncated, dtype=torch.bool)  # (T, N)
        last_row[-1] = True
        reads_bootstrap = truncated.bool() | last_row  # (T, N)
        nv = torch.where(reads_bootstrap, next_value.detach(), 0.0)  # (T, N)
        zero_value = torch.zeros_like(reward)  # (T, N)
        _, returns = compute_gae(reward, zero_value, nv, terminated, truncated, gamma=gamma, gae_lambda=1.0)
    return returns
