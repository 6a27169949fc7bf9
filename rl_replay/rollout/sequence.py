"""The steps of a sequence as the collector runs them, and as a stored one is run again.

Each step is a one-row call of the agent (:func:`step_inputs`: ``(1, N)`` rows), the recurrent
state flows from step to step and is cut by :func:`truncate` every ``bptt_truncate`` steps, and
the outputs other than the state are gathered with :func:`append_outputs` / :func:`cat_outputs`
so the action distribution is built once on the (T, n) outputs (the loss's graph then has a few
nodes in all instead of a few per step, each kept until the backward). Re-running a stored
sequence as replay blocks is the algorithms' business (:mod:`rl_replay.algorithms.stored`):
nothing here imports the engine.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

__all__ = ["append_outputs", "cat_outputs", "step_inputs", "truncate"]


def step_inputs(observation: torch.Tensor | TensorDict, state: TensorDict, is_first: torch.Tensor) -> TensorDict:
    """One step's agent inputs for ``N`` envs as a one-row call: ``observation`` ``(1, N, ...)``,
    ``is_first`` ``(1, N)`` and ``state`` ``[N]``.

    ``device=None``: the observation, the state and the flags may live on different
    devices (a uint8 image on the host, the state on the GPU); nothing is moved.
    """
    return TensorDict(
        observation=observation.unsqueeze(0), state=state, is_first=is_first.unsqueeze(0), batch_size=[], device=None
    )


def truncate(state: TensorDict, t: int, k: int | None) -> TensorDict:
    """The state carried out of step ``t`` (0-based): detached after every ``k``-th step.

    ``k`` is ``collector.bptt_truncate`` (None = never): the gradient of a later step then
    reaches back at most to the last cut.
    """
    if k and (t + 1) % k == 0:
        return state.detach()
    return state


def append_outputs(columns: dict, outputs: TensorDict) -> None:
    """Append one call's ``outputs`` (``[k, N]``, the agent's outputs but the state) to
    ``columns`` (key -> list)."""
    for key, value in outputs.items(include_nested=True, leaves_only=True):
        columns.setdefault(key, []).append(value)


def cat_outputs(columns: dict, T: int, N: int) -> TensorDict:
    """The (T, N) TensorDict of the calls' outputs collected by :func:`append_outputs`,
    for :meth:`~rl_replay.Agent.distribution` and the values."""
    outputs = TensorDict({}, batch_size=[T, N])
    for key, values in columns.items():
        outputs.set(key, values[0] if len(values) == 1 else torch.cat(values))
    return outputs
