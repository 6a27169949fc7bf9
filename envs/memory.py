"""MemoryCue: the action at the end of an episode depends on the first observation."""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces


def _check_int(name: str, value: Any, minimum: int) -> int:
    # bool is an int subclass; `delay=True` is almost certainly a mistake.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_finite(name: str, value: Any) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not np.isfinite(out):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return out


class MemoryCueEnv(gymnasium.Env):
    """Remember a cue shown at the start and report it after ``delay`` distractor steps.

    Observation: float32 vector of length ``num_cues + 2 + noise_dims`` in [-1, 1],
    laid out as ``[cue one-hot (num_cues) | cue_flag | query_flag | noise (noise_dims)]``.

    Timeline (one row per observation the agent acts on, ``delay + 2`` in total):

    - step 0, returned by ``reset()``: the cue one-hot and ``cue_flag = 1``;
    - steps 1 .. delay: distractors, all zeros except the noise channels, which are
      uniform in [-1, 1);
    - step delay + 1: the query, ``query_flag = 1`` and everything else 0.

    Action: ``Discrete(num_cues)``. Actions on the cue and distractor steps are
    ignored and earn 0. The action on the query is scored: ``+1.0`` if it equals the
    cue, ``wrong_reward`` otherwise; the episode then terminates with
    ``info["success"]``. The terminal observation is all zeros (no flag set), so the
    query flag appears on exactly one observation the agent acts on.

    All randomness (cue, noise) comes from ``self.np_random``, seeded by
    ``reset(seed=...)``.
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        delay: int = 64,
        num_cues: int = 2,
        noise_dims: int = 0,
        wrong_reward: float = -1.0,
        render_mode: str | None = None,
    ):
        self.delay = _check_int("delay", delay, 0)
        self.num_cues = _check_int("num_cues", num_cues, 2)
        self.noise_dims = _check_int("noise_dims", noise_dims, 0)
        self.wrong_reward = _check_finite("wrong_reward", wrong_reward)
        if render_mode is not None:
            raise ValueError(f"render_mode is not supported, got {render_mode!r}")
        self.render_mode = render_mode

        # Channel offsets, so the layout is spelled out in one place.
        self._cue_flag = self.num_cues
        self._query_flag = self.num_cues + 1
        self._noise = self.num_cues + 2
        obs_dim = self.num_cues + 2 + self.noise_dims

        self.observation_space = spaces.Box(low=-1.0, high=1.0, shape=(obs_dim,), dtype=np.float32)
        self.action_space = spaces.Discrete(self.num_cues)

        self._cue: int | None = None
        self._t: int | None = None  # index of the observation the next action answers

    def _blank(self) -> np.ndarray:
        return np.zeros(self.observation_space.shape, dtype=np.float32)

    def _cue_obs(self) -> np.ndarray:
        obs = self._blank()
        obs[self._cue] = 1.0
        obs[self._cue_flag] = 1.0
        return obs

    def _distractor_obs(self) -> np.ndarray:
        obs = self._blank()
        if self.noise_dims:
            obs[self._noise :] = self.np_random.uniform(-1.0, 1.0, size=self.noise_dims)
        return obs

    def _query_obs(self) -> np.ndarray:
        obs = self._blank()
        obs[self._query_flag] = 1.0
        return obs

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self._cue = int(self.np_random.integers(self.num_cues))
        self._t = 0
        return self._cue_obs(), {}

    def step(self, action):
        if self._t is None:
            raise RuntimeError("MemoryCueEnv.step() called before reset() or after the episode ended")
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is not in {self.action_space}")

        query_step = self.delay + 1
        if self._t < query_step:
            # Cue or distractor step: the action has no effect.
            self._t += 1
            obs = self._query_obs() if self._t == query_step else self._distractor_obs()
            return obs, 0.0, False, False, {}

        success = int(action) == self._cue
        reward = 1.0 if success else self.wrong_reward
        self._t = None  # the episode is over; force a reset before the next step
        return self._blank(), reward, True, False, {"success": success}
