"""Gymnasium environments for rl_replay, registered on ``import rl_replay.envs``.

Registered ids:

- ``rl_replay/MemoryCue-v0``  -> :class:`rl_replay.envs.memory.MemoryCueEnv` (ends itself, no time limit;
  ``env.vectorization: vector_entry_point`` steps all envs at once, :class:`~rl_replay.envs.memory.MemoryCueVectorEnv`)
- ``rl_replay/POCartPole-v0`` -> :class:`rl_replay.envs.partial_cartpole.PartialObsCartPole` (500 steps)
- ``rl_replay/Chain-v0``      -> :class:`rl_replay.envs.chain.ChainEnv` (ends itself, no time limit)
- ``rl_replay/PassiveTMaze-v0`` -> :class:`rl_replay.envs.tmaze.PassiveTMazeEnv` (ends itself after
  ``corridor_length + 1`` actions)
"""

import gymnasium

from .chain import ChainEnv
from .memory import MemoryCueEnv, MemoryCueVectorEnv
from .partial_cartpole import PartialObsCartPole, make_po_cartpole
from .tmaze import PassiveTMazeEnv

__all__ = [
    "ChainEnv",
    "MemoryCueEnv",
    "MemoryCueVectorEnv",
    "PartialObsCartPole",
    "PassiveTMazeEnv",
    "make_po_cartpole",
]

_REGISTRATIONS = (
    # max_episode_steps=None: the env terminates itself, so make() adds no TimeLimit.
    ("rl_replay/MemoryCue-v0", "rl_replay.envs.memory:MemoryCueEnv", None, "rl_replay.envs.memory:MemoryCueVectorEnv"),
    # Same limit as CartPole-v1 so truncation behaves identically.
    ("rl_replay/POCartPole-v0", "rl_replay.envs.partial_cartpole:make_po_cartpole", 500, None),
    ("rl_replay/Chain-v0", "rl_replay.envs.chain:ChainEnv", None, None),
    ("rl_replay/PassiveTMaze-v0", "rl_replay.envs.tmaze:PassiveTMazeEnv", None, None),
)

for _id, _entry_point, _max_steps, _vector_entry_point in _REGISTRATIONS:
    # Re-registering an id makes gymnasium warn; reloads and repeated imports must be silent.
    if _id not in gymnasium.registry:
        gymnasium.register(
            id=_id, entry_point=_entry_point, max_episode_steps=_max_steps, vector_entry_point=_vector_entry_point
        )
