"""How far back the update's gradient reaches, measured on a collected rollout.

:func:`episode_horizon` replays one episode of a rollout through replay blocks -- as an
update does, with the run's ``bptt_truncate`` -- and measures the norm of the gradient of
the log-probability of the episode's last decision in the rollout with respect to the
episode's first observation. On a memory task run in ``episode`` mode that is the query's
gradient to the cue (what ``scripts/grad_horizon.py`` measures on synthetic episodes), so
a dashboard can show whether the gradient that could teach the agent to store the cue
reaches it at all: 0 when ``bptt_truncate`` cuts it, a float32 underflow when the agent's
recurrence forgets faster than the episode is long.

The trainer logs it every ``log.horizon_every`` updates (``horizon/*`` metrics) through
:meth:`rl_replay.algorithms.base.Algorithm.horizon`, which replays as its update does. It costs
one extra replay of one episode (forward, recompute, backward) at batch size 1, about
``1 / (epochs * num_minibatches)`` of a PPO update's replay time, and leaves the training
RNG streams and the parameters' ``.grad`` as it found them.
"""

from __future__ import annotations

import math

import torch
from tensordict import TensorDict

from rl_replay.agent import Policy
from rl_replay.algorithms.stored import replay_sequence
from rl_replay.engine import GradientAccumulator

__all__ = ["episode_horizon"]


def _episode_span(is_first: torch.Tensor, valid: torch.Tensor) -> tuple[int, int, int] | None:
    """``(env, first_row, last_row)`` of the longest episode start-to-last-valid-row span
    in a (T, N) rollout, or None if no episode starts in it."""
    T, N = is_first.shape
    best = None
    for env in range(N):
        starts = torch.nonzero(is_first[:, env]).flatten().tolist()
        for i, start in enumerate(starts):
            stop = starts[i + 1] if i + 1 < len(starts) else T  # the next episode's first row
            rows = torch.nonzero(valid[start:stop, env]).flatten()
            if len(rows) == 0:
                continue
            last = start + int(rows[-1])
            if best is None or last - start > best[2] - best[1]:
                best = (env, start, last)
    return best


def _float_leaves(observation) -> list[torch.Tensor]:
    if isinstance(observation, TensorDict):
        return [v for v in observation.values(include_nested=True, leaves_only=True) if torch.is_floating_point(v)]  # type: ignore[arg-type, misc]
    return [observation] if torch.is_floating_point(observation) else []


def episode_horizon(
    policy: Policy, data: TensorDict, bptt_truncate: int | None = None, block_steps: int = 1
) -> dict[str, float]:
    """Gradient of an episode's last decision with respect to its first observation.

    Args:
        policy: the :class:`~rl_replay.agent.Policy` the update replays (its module is called,
            its agent gives ``initial_state`` and ``distribution``).
        data: a rollout's (T, N) data with ``observation``, ``is_first``, ``action`` and ``valid``.
        bptt_truncate: detach the recurrent state every K steps, as the update does.
        block_steps: steps per replay block, as the update (``replay.block_steps``); the
            gradient does not depend on it, only the time it takes.

    Returns:
        ``{"horizon/grad_first_obs": norm, "horizon/steps": last_row - first_row}`` for the
        longest episode span that starts inside the rollout (the first row's block resets
        the recurrent state, so no stored state is needed); empty if no episode starts in it
        or the observation has no floating-point part to differentiate.
    """
    span = _episode_span(data["is_first"], data["valid"])
    if span is None:
        return {}
    env, first, last = span
    episode = data[first : last + 1, env : env + 1].select("observation", "is_first", "action")
    obs0 = episode["observation"][0]
    # The first observation's floating-point parts become leaves to differentiate.
    if isinstance(obs0, TensorDict):
        obs0 = obs0.apply(lambda v: v.detach().clone().requires_grad_(True) if torch.is_floating_point(v) else v)
    elif torch.is_floating_point(obs0):
        obs0 = obs0.detach().clone().requires_grad_(True)
    leaves = _float_leaves(obs0)
    if not leaves:
        return {}
    # The first row becomes the leaf; the rest stay the stored rows.
    episode["observation"] = torch.cat([obs0.unsqueeze(0), episode["observation"][1:]])
    params = list(policy.module.parameters())
    # The blocks' backward accumulates into .grad in place: set whatever is there aside
    # (None between updates) and put it back afterwards.
    held = [p.grad for p in params]
    for p in params:
        p.grad = None
    device = episode["is_first"].device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        # (dropout in the blocks must not move the training RNG streams). The first row's
        # block resets the state (is_first), so any start state will do.
        replayed = replay_sequence(
            policy,
            episode,
            policy.agent.initial_state(1, device),
            GradientAccumulator(),
            bptt_truncate,
            block_steps=block_steps,
        )
        replayed["log_prob"][-1].sum().backward()  # not autograd.grad(): replay blocks refuse it
    for p, g in zip(params, held):
        p.grad = g
    grads = [leaf.grad for leaf in leaves]
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads if g is not None))
    return {"horizon/grad_first_obs": norm, "horizon/steps": float(last - first)}
