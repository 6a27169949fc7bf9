"""The plain-autograd reference every replay-parity test compares against.

:func:`plain_sequence` steps an agent over a stored (T, n) sequence from a start state with
ordinary autograd, one graph over all T steps. It is written independently of
:mod:`rl_replay.algorithms.stored` (its own loop, its own truncation rule), so a mistake in the
code under test is not repeated in the reference.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict


def plain_sequence(
    agent, data: TensorDict, start_state: TensorDict, bptt_truncate: int | None = None
) -> tuple[TensorDict, TensorDict]:
    """``agent`` over ``data`` (``observation``, ``is_first``, ``action``; (T, n)) with plain autograd.

    The state flows from step to step and is detached after every ``bptt_truncate``-th
    step (counted from row 0), as the collector and the sequence replay do. The action
    distribution is built once on the stacked (T, n) outputs, as they do, so equal
    gradients give equal floats.

    Returns:
        ``(TensorDict (T, n) with log_prob, entropy, value; the state after the last row)``.
    """
    T, n = data.batch_size
    state = start_state
    outputs = []
    for t in range(T):  # one-row calls
        out = agent(observation=data["observation"][t : t + 1], state=state, is_first=data["is_first"][t : t + 1])
        outputs.append(out["outputs"])
        state = out["state"]
        if bptt_truncate is not None and t % bptt_truncate == bptt_truncate - 1:
            state = state.detach()
    heads = torch.cat(outputs)
    dist = agent.distribution(heads)
    result = TensorDict(
        log_prob=dist.log_prob(data["action"]), entropy=dist.entropy(), value=heads["value"], batch_size=[T, n]
    )
    return result, state


def plain_blocks(
    agent, data: TensorDict, start_state: TensorDict, block_steps: int, bptt_truncate: int | None = None
) -> TensorDict:
    """``agent``'s sequence forward over ``data`` with plain autograd, one call per block.

    Blocks hold ``block_steps`` rows and end at every multiple of ``bptt_truncate``, where the
    state is detached; each is one call ``agent(observation=rows, state=..., is_first=rows)``
    with ``(k, n)`` inputs (:meth:`~rl_replay.Agent.forward`). The distribution is built
    once on the stacked (T, n) outputs.
    """
    T, n = data.batch_size
    state, heads, t = start_state, [], 0
    while t < T:
        stop = min(T, t + block_steps)
        if bptt_truncate is not None:
            stop = min(stop, t - t % bptt_truncate + bptt_truncate)
        out = agent(observation=data["observation"][t:stop], state=state, is_first=data["is_first"][t:stop])
        heads.append(out["outputs"])
        state = out["state"]
        if bptt_truncate is not None and stop % bptt_truncate == 0:
            state = state.detach()
        t = stop
    stacked = torch.cat(heads)
    dist = agent.distribution(stacked)
    return TensorDict(
        log_prob=dist.log_prob(data["action"]), entropy=dist.entropy(), value=stacked["value"], batch_size=[T, n]
    )
