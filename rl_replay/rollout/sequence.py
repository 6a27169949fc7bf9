"""The steps of a sequence as the collector runs them, and as a stored one is run again.

Each step's inputs are :func:`block_inputs`, the recurrent state flows from step to step and is
cut by :func:`truncate` every ``bptt_truncate`` steps, and the outputs other than the state are
gathered with :func:`append_outputs` / :func:`stack_outputs` so the action distribution is built once
on the stacked (T, n) outputs (the loss's graph then has a few nodes in all instead of a few per
step, each kept until the backward). Re-running a stored sequence as replay blocks is the
algorithms' business (:mod:`rl_replay.algorithms.stored`): nothing here imports the engine.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

__all__ = ["append_outputs", "block_inputs", "stack_outputs", "truncate"]


def block_inputs(
    observation: torch.Tensor | TensorDict, state: TensorDict, is_first: torch.Tensor, n: int
) -> TensorDict:
    """One step's agent inputs for ``n`` envs: ``observation``, ``state`` and ``is_first``.

    ``device=None``: the observation, the state and the flags may live on different
    devices (a uint8 image on the host, the state on the GPU); nothing is moved.
    """
    return TensorDict(observation=observation, state=state, is_first=is_first, batch_size=[n], device=None)


def truncate(state: TensorDict, t: int, k: int | None) -> TensorDict:
    """The state carried out of step ``t`` (0-based): detached after every ``k``-th step.

    ``k`` is ``collector.bptt_truncate`` (None = never): the gradient of a later step then
    reaches back at most to the last cut.
    """
    if k and (t + 1) % k == 0:
        return state.detach()
    return state


def append_outputs(columns: dict, out: TensorDict) -> None:
    """Append one step's agent outputs except ``state`` to ``columns`` (key -> list)."""
    for key, value in out.items(include_nested=True, leaves_only=True):
        if key != "state" and not (isinstance(key, tuple) and key[0] == "state"):
            columns.setdefault(key, []).append(value)


def stack_outputs(columns: dict, T: int, N: int) -> TensorDict:
    """The (T, N) TensorDict of the steps' outputs collected by :func:`append_outputs`,
    for :meth:`~rl_replay.Agent.distribution` and the values."""
    outputs = TensorDict({}, batch_size=[T, N])
    for key, values in columns.items():
        outputs.set(key, torch.stack(values))
    return outputs
