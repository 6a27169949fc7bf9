"""POCartPole: CartPole with the velocities hidden, so the agent must infer them."""

from __future__ import annotations

import gymnasium
import numpy as np
from gymnasium import spaces
from gymnasium.envs.classic_control.cartpole import CartPoleEnv

# Indices into CartPole's observation [x, x_dot, theta, theta_dot] that stay visible.
VISIBLE = (0, 2)


class PartialObsCartPole(gymnasium.ObservationWrapper):
    """Keep only cart position and pole angle from a CartPole observation.

    Observation: float32 ``[cart position, pole angle]`` with CartPole's bounds for
    those two entries. Actions, rewards, termination and truncation are CartPole's
    unchanged. Without the velocities a memoryless policy cannot balance well, so
    this is a cheap test of recurrent agents.
    """

    def __init__(self, env: gymnasium.Env):
        super().__init__(env)
        inner = env.observation_space
        idx = list(VISIBLE)
        self.observation_space = spaces.Box(low=inner.low[idx], high=inner.high[idx], dtype=np.float32)

    def observation(self, observation):
        return np.asarray(observation, dtype=np.float32)[list(VISIBLE)]


def make_po_cartpole(**kwargs) -> PartialObsCartPole:
    """Entry point for ``rl_replay/POCartPole-v0``; kwargs go to ``CartPoleEnv``.

    The 500-step limit is not applied here: the registration's
    ``max_episode_steps=500`` makes ``gymnasium.make`` add the TimeLimit, as for
    CartPole-v1.
    """
    return PartialObsCartPole(CartPoleEnv(**kwargs))
