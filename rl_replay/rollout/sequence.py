"""A stored (T, n) sequence run through the agent step by step, from a start state.

What the collector does while it steps the envs, an update or a diagnostic does again on
the stored rows: each step's inputs are :func:`block_inputs`, the recurrent state flows
from step to step and is cut by :func:`truncate` every ``bptt_truncate`` steps, and the
outputs other than the state are gathered with :func:`append_heads` / :func:`stack_heads`
so the action distribution is built once on the stacked (T, n) outputs (the loss's graph
then has a few nodes in all instead of a few per step, each kept until the backward).
:func:`replay_sequence` is that loop over a stored sequence (PPO's minibatches,
:mod:`rl_replay.run.horizon`).

Imports the engine and nothing from the algorithms or the trainer.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rl_replay.agent import has_sequence_forward
from rl_replay.engine import GradientAccumulator, replay, replay_steps

__all__ = ["append_heads", "block_inputs", "block_spans", "replay_sequence", "stack_heads", "truncate"]


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


def block_spans(T: int, block_steps: int, bptt_truncate: int | None = None) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` rows of the multi-step blocks covering T steps: at most
    ``block_steps`` each, and never across a ``bptt_truncate`` cut (a block ends at every
    multiple of it), so the state is detached exactly where one-step blocks detach it."""
    spans, start = [], 0
    while start < T:
        stop = min(T, start + block_steps)
        if bptt_truncate:
            stop = min(stop, (start // bptt_truncate + 1) * bptt_truncate)
        spans.append((start, stop))
        start = stop
    return spans


def replay_sequence(
    model: torch.nn.Module,
    policy,
    data: TensorDict,
    start_state: TensorDict,
    accumulator: GradientAccumulator | None,
    bptt_truncate: int | None = None,
    block_steps: int = 1,
) -> TensorDict:
    """Re-run a stored (T, n) sequence step by step; returns ``log_prob``, ``entropy``, ``value``.

    Args:
        model: what the collector called (the FSDP-wrapped root under FSDP).
        policy: the :class:`~rl_replay.agent.Agent` (for ``distribution``).
        data: (T, n) with ``observation``, ``is_first`` and ``action``.
        start_state: the n envs' recurrent state before row 0.
        accumulator: a fresh GradientAccumulator: every step is a replay block, and only
            the blocks' inputs are kept until the backward. None runs ``model(**inputs)``
            with plain autograd, every step's graph kept: the recipe benchmarks compare
            against (``scripts/bench/bench_ppo.py``).
        bptt_truncate: detach the state every K steps, as the collector does (counted
            from row 0).
        block_steps: steps per replay block (:func:`~rl_replay.engine.replay_steps`): the
            per-block machinery is paid once per block, and one block's k steps of activations
            are alive at the backward's peak. An agent with its own
            :meth:`~rl_replay.Agent.forward_steps` runs each block as one call of it (so do
            the plain-autograd runs, ``accumulator=None``, which then make the same calls);
            others are called step by step, with the same gradients for every value.
            A stateless agent (``start_state`` holds no tensor) has no recurrence linking its
            steps, so a block runs its k steps as one call over ``k * n`` rows (one
            :func:`~rl_replay.engine.replay` block): gradients then equal plain autograd's on
            that batched call, as in the usual batched PPO / A2C recompute, not the per-step
            loop's to the last bit (a batched matmul sums in another order).

    Returns:
        TensorDict (T, n) whose entries are attached to autograd through the steps.
    """
    T, n = data.batch_size
    observation, is_first = data["observation"], data["is_first"]
    state = start_state
    if accumulator is not None and block_steps > 1 and start_state.is_empty():
        return _replay_stateless(model, policy, data, accumulator, block_steps)
    sequence = block_steps > 1 and has_sequence_forward(policy)
    if sequence or (accumulator is not None and block_steps > 1):
        blocks = []
        for start, stop in block_spans(T, block_steps, bptt_truncate):
            steps = TensorDict(
                observation=observation[start:stop],
                is_first=is_first[start:stop],
                batch_size=[stop - start, n],
                device=None,
            )
            if accumulator is not None:
                heads, state = replay_steps(model, accumulator, steps, state, sequence=sequence)
            else:  # plain autograd over the same calls
                out = model(**steps, state=state)
                heads, state = out["heads"], out["state"]
            state = truncate(state, stop - 1, bptt_truncate)
            blocks.append(heads)
        return _sequence_outputs(policy, blocks, data)
    columns: dict = {}
    for t in range(T):
        inputs = block_inputs(observation[t], state, is_first[t], n)
        out = replay(model, accumulator, inputs) if accumulator is not None else model(**inputs)
        append_heads(columns, out)
        state = truncate(out["state"], t, bptt_truncate)
        del out
    heads = stack_heads(columns, T, n)
    del columns
    return _sequence_outputs(policy, [heads], data)


def _replay_stateless(
    model: torch.nn.Module, policy, data: TensorDict, accumulator: GradientAccumulator, block_steps: int
) -> TensorDict:
    """:func:`replay_sequence` for a stateless agent: each block of ``block_steps`` rows is one
    replay block, the agent called once on the block's ``k * n`` rows (``is_first`` only resets
    a state, so it changes nothing here; it is passed on as the contract asks)."""
    T, n = data.batch_size
    observation, is_first = data["observation"], data["is_first"]
    blocks = []
    for start, stop in block_spans(T, block_steps):
        k = stop - start
        inputs = TensorDict(
            observation=observation[start:stop].flatten(0, 1),
            state=TensorDict({}, batch_size=[k * n], device=None),
            is_first=is_first[start:stop].flatten(0, 1),
            batch_size=[k * n],
            device=None,
        )
        out = replay(model, accumulator, inputs)
        blocks.append(out.exclude("state").unflatten(0, (k, n)))
    return _sequence_outputs(policy, blocks, data)


def _sequence_outputs(policy, blocks: list[TensorDict], data: TensorDict) -> TensorDict:
    """``log_prob``, ``entropy`` and ``value`` (T, n) from the blocks' stacked heads, in order:
    one distribution over all T rows. Empties ``blocks``, so only ``heads`` holds them."""
    heads = blocks[0] if len(blocks) == 1 else torch.cat(blocks)  # type: ignore[arg-type]
    blocks.clear()
    dist = policy.distribution(heads)
    return TensorDict(
        log_prob=dist.log_prob(data["action"]),
        entropy=dist.entropy(),
        value=heads["value"],  # type: ignore[index]
        batch_size=data.batch_size,
    )
