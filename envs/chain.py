"""Chain: a tiny deterministic environment whose returns can be computed by hand."""

from __future__ import annotations

import gymnasium
import numpy as np
from gymnasium import spaces


class ChainEnv(gymnasium.Env):
    """Walk down a chain of ``length`` steps; meant for tests, not for learning.

    Observation: float32 vector of length ``obs_dim`` in [0, 1]; channel 0 is
    ``t / length`` where ``t`` is the number of steps taken so far (0 after reset,
    1.0 on the terminal observation), every other channel is 0.

    Action: ``Discrete(2)``; actions do not affect anything.

    Reward: the ``t``-th step (``t = 0`` for the first step after reset) pays
    ``float(t + 1)``, so an episode pays 1, 2, ..., ``length`` and returns
    ``length * (length + 1) / 2`` undiscounted. The episode terminates after exactly
    ``length`` steps. There is no randomness at all.
    """

    metadata = {"render_modes": []}

    def __init__(self, length: int = 5, obs_dim: int = 3, render_mode: str | None = None):
        for name, value in (("length", length), ("obs_dim", obs_dim)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"{name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if render_mode is not None:
            raise ValueError(f"render_mode is not supported, got {render_mode!r}")
        self.length = int(length)
        self.obs_dim = int(obs_dim)
        self.render_mode = render_mode

        self.observation_space = spaces.Box(low=0.0, high=1.0, shape=(self.obs_dim,), dtype=np.float32)
        self.action_space = spaces.Discrete(2)
        self._t: int | None = None

    def _obs(self) -> np.ndarray:
        obs = np.zeros(self.obs_dim, dtype=np.float32)
        obs[0] = self._t / self.length
        return obs

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        # Seeding is a no-op for the dynamics but keeps the Env API contract.
        super().reset(seed=seed)
        self._t = 0
        return self._obs(), {}

    def step(self, action):
        if self._t is None or self._t >= self.length:
            raise RuntimeError("ChainEnv.step() called before reset() or after the episode ended")
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is not in {self.action_space}")
        reward = float(self._t + 1)
        self._t += 1
        terminated = self._t == self.length
        return self._obs(), reward, terminated, False, {}
