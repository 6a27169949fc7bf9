"""A stored (T, n) sequence run through the agent step by step, from a start state.

What the collector does while it steps the envs, an update or a diagnostic does again on
the stored rows: each step's inputs are :func:`block_inputs`, the recurrent state flows
from step to step and is cut by :func:`truncate` every ``bptt_truncate`` steps, and the
outputs other than the state are gathered with :func:`append_heads` / :func:`stack_heads`
so the action distribution is built once on the stacked (T, n) outputs (the loss's graph
then has a few nodes in all instead of a few per step, each kept until the backward).
:func:`replay_sequence` is that loop over a stored sequence (PPO's minibatches,
:mod:`rl_replay.horizon`).

Imports the engine and nothing from the algorithms or the trainer.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rl_replay.engine import GradientAccumulator, replay

__all__ = ["append_heads", "block_inputs", "replay_sequence", "stack_heads", "truncate"]


def block_inputs(observation: torch.Tensor | TensorDict, state: TensorDict, is_first: torch.Tensor,
                 n: int) -> TensorDict:
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


def append_heads(columns: dict, out: TensorDict) -> None:
    """Append one step's agent outputs except ``state`` to ``columns`` (key -> list)."""
    for key, value in out.items(include_nested=True, leaves_only=True):
        if key != "state" and not (isinstance(key, tuple) and key[0] == "state"):
            columns.setdefault(key, []).append(value)


def stack_heads(columns: dict, T: int, N: int) -> TensorDict:
    """The (T, N) TensorDict of the steps' outputs collected by :func:`append_heads`,
    for :meth:`~rl_replay.Agent.distribution` and the values."""
    heads = TensorDict({}, batch_size=[T, N])
    for key, values in columns.items():
        heads.set(key, torch.stack(values))
    return heads


def replay_sequence(model: torch.nn.Module, policy, data: TensorDict, start_state: TensorDict,
                    accumulator: GradientAccumulator | None, bptt_truncate: int | None = None) -> TensorDict:
    """Re-run a stored (T, n) sequence step by step; returns ``log_prob``, ``entropy``, ``value``.

    Args:
        model: what the collector called (the FSDP-wrapped root under FSDP).
        policy: the :class:`~rl_replay.agent.Agent` (for ``distribution``).
        data: (T, n) with ``observation``, ``is_first`` and ``action``.
        start_state: the n envs' recurrent state before row 0.
        accumulator: a fresh GradientAccumulator: every step is a replay block, and only
            the blocks' inputs are kept until the backward. None runs ``model(**inputs)``
            with plain autograd, every step's graph kept: the recipe benchmarks compare
            against (``scripts/bench_ppo.py``).
        bptt_truncate: detach the state every K steps, as the collector does (counted
            from row 0).

    Returns:
        TensorDict (T, n) whose entries are attached to autograd through the steps.
    """
    T, n = data.batch_size
    observation, is_first = data["observation"], data["is_first"]
    state = start_state
    columns: dict = {}
    for t in range(T):
        inputs = block_inputs(observation[t], state, is_first[t], n)
        out = replay(model, accumulator, inputs) if accumulator is not None else model(**inputs)
        append_heads(columns, out)
        state = truncate(out["state"], t, bptt_truncate)
        del out
    heads = stack_heads(columns, T, n)
    del columns
    dist = policy.distribution(heads)
    return TensorDict(log_prob=dist.log_prob(data["action"]), entropy=dist.entropy(),
                      value=heads["value"], batch_size=[T, n])
