"""Small envs with Dict, Tuple, uint8-image and text observations for the tests (registered on import).

Each episode lasts ``length`` steps; the reward is 1 when the action equals the parity of
the step counter, so there is something to learn and episodes end inside a rollout.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np


class _CountingEnv(gym.Env):
    def __init__(self, length: int = 5):
        self.length = length
        self.action_space = gym.spaces.Discrete(2)
        self._t = 0

    def _obs(self):
        raise NotImplementedError

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t = 0
        return self._obs(), {}

    def step(self, action):
        reward = float(int(action) == self._t % 2)
        self._t += 1
        return self._obs(), reward, self._t >= self.length, False, {}


class DictObsEnv(_CountingEnv):
    """``Dict(pos: Box(2,), phase: Discrete(3), nested: Dict(flags: MultiBinary(2), code: MultiDiscrete([2, 3])))``."""

    def __init__(self, length: int = 5):
        super().__init__(length)
        self.observation_space = gym.spaces.Dict(
            {
                "pos": gym.spaces.Box(-1.0, 1.0, (2,), np.float32),
                "phase": gym.spaces.Discrete(3),
                "nested": gym.spaces.Dict(
                    {
                        "flags": gym.spaces.MultiBinary(2),
                        "code": gym.spaces.MultiDiscrete([2, 3]),
                    }
                ),
            }
        )

    def _obs(self):
        x = self.np_random.uniform(-1, 1, 2).astype(np.float32)
        return {
            "pos": x,
            "phase": self._t % 3,
            "nested": {
                "flags": np.array([self._t % 2, 1], np.int8),
                "code": np.array([self._t % 2, self._t % 3], np.int64),
            },
        }


class TupleObsEnv(_CountingEnv):
    """``Tuple(Discrete(4), Box(3,))``."""

    def __init__(self, length: int = 5):
        super().__init__(length)
        self.observation_space = gym.spaces.Tuple((gym.spaces.Discrete(4), gym.spaces.Box(0.0, 1.0, (3,), np.float32)))

    def _obs(self):
        return (self._t % 4, np.full(3, self._t / self.length, np.float32))


class ImageObsEnv(_CountingEnv):
    """``Box(0, 255, shape, dtype)`` images; ``dtype`` uint8 (default) or float32, ``shape``
    (8, 8, 3) by default (any image layout: (H, W), (H, W, C), (C, H, W), (S, H, W, C))."""

    def __init__(self, length: int = 5, dtype: str = "uint8", shape=(8, 8, 3)):
        super().__init__(length)
        self.observation_space = gym.spaces.Box(0, 255, tuple(shape), np.dtype(dtype))

    def _obs(self):
        img = self.np_random.integers(0, 256, self.observation_space.shape)
        return img.astype(self.observation_space.dtype)


class MissionObsEnv(_CountingEnv):
    """MiniGrid's layout: ``Dict(image: Box(0, 255, (7, 7, 3), uint8), direction: Discrete(4),
    mission: Text)``; ``text_only`` keeps the mission alone (nothing a tensor can hold)."""

    def __init__(self, length: int = 5, text_only: bool = False):
        super().__init__(length)
        spaces = {"mission": gym.spaces.Text(32, charset="abcdefghijklmnopqrstuvwxyz ")}
        if not text_only:
            spaces = {
                "image": gym.spaces.Box(0, 255, (7, 7, 3), np.uint8),
                "direction": gym.spaces.Discrete(4),
                **spaces,
            }
        self.observation_space = gym.spaces.Dict(spaces)

    def _obs(self):
        obs = {"mission": "get the ball"}
        if "image" in self.observation_space.spaces:
            obs["image"] = self.np_random.integers(0, 11, (7, 7, 3)).astype(np.uint8)
            obs["direction"] = self._t % 4
        return obs


for _name, _cls in (
    ("DictObs", "DictObsEnv"),
    ("TupleObs", "TupleObsEnv"),
    ("ImageObs", "ImageObsEnv"),
    ("MissionObs", "MissionObsEnv"),
):
    if f"test/{_name}-v0" not in gym.registry:
        gym.register(id=f"test/{_name}-v0", entry_point=f"obs_envs:{_cls}")


class FailsLater(gym.Wrapper):
    """Raises on the ``after``-th step it is given (counted across episodes): a wrapper whose fault
    shows only mid-episode, after a probe step has passed."""

    def __init__(self, env: gym.Env, after: int = 10):
        super().__init__(env)
        self.after, self.steps = after, 0

    def step(self, action):
        self.steps += 1
        if self.steps >= self.after:
            raise ZeroDivisionError("a reward scale of 0")
        return self.env.step(action)
