"""A stored (T, n) rollout re-run as replay blocks from its start state: the k-step story, told once.

An update (PPO's minibatches, A2C / REINFORCE with ``replay.block_steps`` > 1) and the horizon
diagnostic run the agent again over rows the collector stored, with the gradient attached
through replay blocks that share one accumulator. :func:`replay_sequence` decides how a block
covers its steps, in this one place:

* ``block_steps`` 1: one replay block per step (:func:`rl_replay.engine.replay`);
* a stateless agent (``start_state`` holds no tensor): each block of k steps is one call over
  ``k * n`` rows, the usual batched recompute;
* an agent whose class overrides :meth:`~rl_replay.Agent.forward_steps`
  (:func:`rl_replay.agent.has_sequence_forward`): each block of k steps is one call of it
  (:func:`rl_replay.engine.replay_steps` with ``sequence=True``);
* any other agent: each block of k steps is k calls of its ``forward`` inside one block.

Blocks never cross a ``bptt_truncate`` cut (:func:`block_spans`). Plain-autograd references
live with the tests (``tests/_reference.py``) and the benchmarks, not here.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rl_replay.agent import Policy, has_sequence_forward
from rl_replay.engine import GradientAccumulator, replay, replay_steps
from rl_replay.rollout.sequence import append_outputs, block_inputs, stack_outputs, truncate

__all__ = ["block_spans", "replay_sequence"]


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
    policy: Policy,
    data: TensorDict,
    start_state: TensorDict,
    accumulator: GradientAccumulator,
    bptt_truncate: int | None = None,
    block_steps: int = 1,
) -> TensorDict:
    """Re-run a stored (T, n) sequence as replay blocks; returns ``log_prob``, ``entropy``, ``value``.

    Args:
        policy: the :class:`~rl_replay.agent.Policy`: its ``module`` is called (the FSDP-wrapped
            root under FSDP), its ``agent`` builds the distribution.
        data: (T, n) with ``observation``, ``is_first`` and ``action``.
        start_state: the n envs' recurrent state before row 0.
        accumulator: a fresh GradientAccumulator shared by the blocks: only their inputs are
            kept until the backward.
        bptt_truncate: detach the state every K steps, as the collector does (counted
            from row 0).
        block_steps: steps per replay block (:func:`~rl_replay.engine.replay_steps`): the
            per-block machinery is paid once per block, and one block's k steps of activations
            are alive at the backward's peak. An agent with its own
            :meth:`~rl_replay.Agent.forward_steps` runs each block as one call of it; others are
            called step by step, with the same gradients for every value.
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
    model, agent = policy.module, policy.agent
    state = start_state
    if block_steps > 1 and start_state.is_empty():
        return _replay_stateless(model, agent, data, accumulator, block_steps)
    if block_steps > 1:
        sequence = has_sequence_forward(agent)
        blocks = []
        for start, stop in block_spans(T, block_steps, bptt_truncate):
            steps = TensorDict(
                observation=observation[start:stop],
                is_first=is_first[start:stop],
                batch_size=[stop - start, n],
                device=None,
            )
            outputs, state = replay_steps(model, accumulator, steps, state, sequence=sequence)
            state = truncate(state, stop - 1, bptt_truncate)
            blocks.append(outputs)
        return _sequence_outputs(agent, blocks, data)
    columns: dict = {}
    for t in range(T):
        inputs = block_inputs(observation[t], state, is_first[t], n)
        out = replay(model, accumulator, inputs)
        append_outputs(columns, out)
        state = truncate(out["state"], t, bptt_truncate)
        del out
    outputs = stack_outputs(columns, T, n)
    del columns
    return _sequence_outputs(agent, [outputs], data)


def _replay_stateless(
    model: torch.nn.Module, agent, data: TensorDict, accumulator: GradientAccumulator, block_steps: int
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
    return _sequence_outputs(agent, blocks, data)


def _sequence_outputs(agent, blocks: list[TensorDict], data: TensorDict) -> TensorDict:
    """``log_prob``, ``entropy`` and ``value`` (T, n) from the blocks' stacked outputs, in order:
    one distribution over all T rows. Empties ``blocks``, so only ``outputs`` holds them."""
    outputs = blocks[0] if len(blocks) == 1 else torch.cat(blocks)  # type: ignore[arg-type]
    blocks.clear()
    dist = agent.distribution(outputs)
    return TensorDict(
        log_prob=dist.log_prob(data["action"]),
        entropy=dist.entropy(),
        value=outputs["value"],  # type: ignore[index]
        batch_size=data.batch_size,
    )
