"""What a run will need in memory, estimated from its config before anything large is built.

A config may come from someone else's run, and sizes that pass every range check can still ask
for more than the machine has: an agent of ``hidden_sizes: [100000, 100000]`` or a rollout of
65,536 envs x 16M steps. Building them would exhaust memory minutes in, with a traceback (or
the OOM killer). :func:`check_fits` estimates the agent by building it on PyTorch's ``meta``
device (shapes only, no storage) and the rollout from the observation space, and refuses in
one line when the sum is above the memory this process can have.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch

from rl_replay.errors import SetupError
from rl_replay.targets import OWN, Importer

__all__ = ["agent_parameters", "rollout_bytes", "check_fits"]

# Per parameter: the weights, their gradient and two optimizer moments (Adam), float32 each.
_BYTES_PER_TRAINED_PARAMETER = 4 * 4
# Per collected step and env besides the observation: action, log-prob, value, reward, flags,
# and the row's share of the stored tensors' bookkeeping.
_BYTES_PER_STEP = 64


def agent_parameters(
    target: str, kwargs: dict[str, Any], observation_space, action_space, importer: Importer = OWN
) -> int | None:
    """The number of parameters the agent would have, counted on the ``meta`` device (no memory);
    None when the agent cannot be built there (it reads values in its constructor)."""
    from rl_replay.agent import build_agent

    try:
        # (fork_rng: a run's real agent is initialised from the same random numbers as without this)
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            agent = build_agent(target, kwargs, observation_space, action_space, importer)
    except SetupError:
        raise
    except Exception:  # an agent whose constructor needs real values: not estimated
        return None
    return sum(p.numel() for p in agent.parameters())


def _space_bytes(space: gym.Space) -> int:
    if isinstance(space, gym.spaces.Dict):
        return sum(_space_bytes(s) for s in space.spaces.values())
    if isinstance(space, gym.spaces.Tuple):
        return sum(_space_bytes(s) for s in space.spaces)
    shape = space.shape or ()
    return int(np.prod(shape, dtype=np.float64)) * max(4, np.dtype(space.dtype or np.float32).itemsize)


def rollout_bytes(num_envs: int, num_steps: int, observation_space: gym.Space) -> int:
    """The bytes of one rollout's stored steps (observations as tensors, plus per-step columns)."""
    return num_envs * num_steps * (_space_bytes(observation_space) + _BYTES_PER_STEP)


def _gib(nbytes: float) -> str:
    return f"{nbytes / (1 << 30):.1f} GiB"


def check_fits(
    cfg: Any, observation_space: gym.Space, action_space: gym.Space, *, train: bool = True, importer: Importer = OWN
) -> None:
    """Refuse (one line, :class:`~rl_replay.errors.SetupError`) a config whose agent and, when
    ``train``, rollout need more memory than this process can have; builds nothing real."""
    from rl_replay.rundir.files import memory_left

    params = agent_parameters(cfg.agent.target, cfg.agent.kwargs, observation_space, action_space, importer)
    agent = (params or 0) * (_BYTES_PER_TRAINED_PARAMETER if train else 4)
    rollout = rollout_bytes(cfg.env.num_envs, cfg.collector.num_steps, observation_space) if train else 0
    left = memory_left()
    if agent + rollout > left:
        with_state = ", with gradients and optimizer state" if train else ""
        parts = [f"the agent ({params:,} parameters{with_state}: {_gib(agent)})"] if params else []
        if train:
            parts.append(f"a rollout of {cfg.env.num_envs} envs x {cfg.collector.num_steps} steps ({_gib(rollout)})")
        raise SetupError(
            f"{' and '.join(parts)} need about {_gib(agent + rollout)}, more than this process can have "
            f"({_gib(left)} free): lower agent.kwargs' sizes, env.num_envs or collector.num_steps."
        )
