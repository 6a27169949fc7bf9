"""A stored (T, n) rollout re-run as replay blocks from its start state: the k-step story, told once.

An update (PPO's minibatches, A2C / REINFORCE with ``replay.block_steps`` > 1) and the horizon
diagnostic run the agent again over rows the collector stored, with the gradient attached
through replay blocks that share one accumulator. :func:`replay_sequence` decides how a block
covers its steps, in this one place:

* ``block_steps`` 1: one replay block per step, a one-row call (:func:`rl_replay.engine.replay`);
* an :class:`~rl_replay.Agent`: each block of k steps is one call over its k rows
  (:func:`rl_replay.engine.replay_sequence_call`);
* a :class:`~rl_replay.StepwiseAgent`: each block of k steps calls the agent once per step
  (:func:`rl_replay.engine.replay_steps`), as its own loop does.

Blocks never cross a ``bptt_truncate`` cut (:func:`block_spans`). Plain-autograd references
live with the tests (``tests/_reference.py``) and the benchmarks, not here.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rl_replay.agent import Policy, StepwiseAgent
from rl_replay.engine import GradientAccumulator, replay, replay_sequence_call, replay_steps
from rl_replay.rollout.sequence import append_outputs, cat_outputs, step_inputs, truncate

__all__ = ["OneStep", "block_spans", "replay_sequence"]


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
        block_steps: steps per replay block: the per-block machinery is paid once per block,
            and one block's k steps of activations are alive at the backward's peak. The
            gradients equal plain autograd's running the same calls (one call over each block's
            rows; a :class:`~rl_replay.StepwiseAgent`'s steps one by one).

    Returns:
        TensorDict (T, n) whose entries are attached to autograd through the steps.
    """
    T, n = data.batch_size
    observation, is_first = data["observation"], data["is_first"]
    model, agent = policy.module, policy.agent
    state = start_state
    columns: dict = {}
    if block_steps > 1:
        one_step = OneStep(model) if isinstance(agent, StepwiseAgent) else None
        for start, stop in block_spans(T, block_steps, bptt_truncate):
            steps = TensorDict(
                observation=observation[start:stop],
                is_first=is_first[start:stop],
                batch_size=[stop - start, n],
                device=None,
            )
            if one_step is not None:
                outputs, state = replay_steps(one_step, accumulator, steps, state)
            else:
                outputs, state = replay_sequence_call(model, accumulator, steps, state)
            state = truncate(state, stop - 1, bptt_truncate)
            append_outputs(columns, outputs)
    else:
        for t in range(T):
            out = replay(model, accumulator, step_inputs(observation[t], state, is_first[t]))
            append_outputs(columns, out["outputs"])
            state = truncate(out["state"], t, bptt_truncate)
            del out
    outputs = cat_outputs(columns, T, n)
    del columns
    dist = agent.distribution(outputs)
    return TensorDict(
        log_prob=dist.log_prob(data["action"]),
        entropy=dist.entropy(),
        value=outputs["value"],
        batch_size=data.batch_size,
    )


class OneStep:
    """``module`` called on one step's ``(n, ...)`` inputs as a one-row call, returning the step's
    outputs beside the next ``state``: the per-step model :func:`~rl_replay.engine.replay_steps`
    calls for a :class:`~rl_replay.StepwiseAgent`. Through the module itself, so that under FSDP
    its hooks gather the parameters for each step."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.__self__ = module  # the engine's plan watches (and under FSDP syncs) this module

    def __call__(self, observation, state: TensorDict, is_first: torch.Tensor) -> TensorDict:
        out = self.__self__(**step_inputs(observation, state, is_first))
        step = out["outputs"][0]
        step["state"] = out["state"]
        return step
