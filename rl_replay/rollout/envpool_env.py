"""EnvPool as a gymnasium vector env: ``env.vectorization: envpool``.

`EnvPool <https://github.com/sail-sg/envpool>`_ steps a batch of environments in C++ threads (Atari,
classic control, MuJoCo). :class:`EnvPoolVectorEnv` gives the collector what a gymnasium vector env
gives it:

* **next-step autoreset**, as EnvPool's gymnasium API already does: the step after an episode ended
  returns the new episode's first observation with reward 0 and its action ignored (the collector's
  ``is_first`` and its episode bookkeeping are unchanged);
* **terminated vs truncated** as EnvPool reports them (a time limit is a truncation);
* **raw returns**: EnvPool's Atari envs clip rewards themselves (``reward_clip``) and report the
  game's own reward in ``info["reward"]``; each finished episode's sum of those is reported under
  :data:`~rl_replay.rollout.environment.RAW_EPISODE_KEY`, where the gymnasium path's
  ``RecordEpisodeStatistics`` beneath the wrappers puts it, so ``rollout/return_*`` are the game's
  score on both paths;
* **observations** of the single env's space; a frame stack of one (``stack_num: 1``) is squeezed
  to ``(height, width)``, the shape of gymnasium's ``AtariPreprocessing``.

EnvPool's preprocessing is configured by its own keyword arguments (``env.kwargs``: ``frame_skip``,
``noop_max``, ``episodic_life``, ``reward_clip``, ``stack_num``, ``img_height``...), not by gymnasium
wrappers, so ``env.wrappers`` and ``env.observation_keys`` are refused under it. Its envs live in
EnvPool's threads and cannot be pickled: a resume starts fresh episodes and says so in one line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np

from rl_replay.errors import SetupError, one_line, shown
from rl_replay.rollout.environment import RAW_EPISODE_KEY

__all__ = ["EnvPoolVectorEnv", "envpool_task_id"]

OTHERS = "use env.vectorization=sync, async or vector_entry_point"


def _envpool():
    try:
        import envpool
    except ImportError:
        raise SetupError(
            "env.vectorization=envpool needs EnvPool, which is not installed: pip install -e '.[envpool]' "
            f"(Linux x86-64, CPython 3.8-3.12); or {OTHERS}."
        ) from None
    return envpool


def envpool_task_id(env_id: str) -> str:
    """EnvPool's id for the gymnasium id ``env_id`` (``ALE/Pong-v5`` is EnvPool's ``Pong-v5``); one
    line naming the other vectorizations for an id EnvPool does not have."""
    envpool = _envpool()
    known = set(envpool.list_all_envs())
    for candidate in (env_id, env_id.removeprefix("ALE/")):
        if candidate in known:
            return candidate
    raise SetupError(
        f"env.vectorization=envpool: EnvPool has no environment {shown(env_id)} (it has {len(known)}: Atari as "
        f"e.g. Pong-v5, classic control as CartPole-v1, MuJoCo as HalfCheetah-v4); {OTHERS}."
    )


class EnvPoolVectorEnv(gym.vector.VectorEnv):
    """``num_envs`` EnvPool envs of ``env_id`` behind gymnasium's vector-env interface (see the
    module docstring for what is kept the same); ``kwargs`` are EnvPool's own."""

    metadata = {"autoreset_mode": gym.vector.AutoresetMode.NEXT_STEP}

    def __init__(
        self,
        env_id: str,
        num_envs: int,
        kwargs: Mapping[str, Any] | None = None,
        max_episode_steps: int | None = None,
    ) -> None:
        self.task_id = envpool_task_id(env_id)
        self.env_id = env_id
        self._kwargs = dict(kwargs or {})
        if max_episode_steps is not None:
            self._kwargs["max_episode_steps"] = max_episode_steps
        self.num_envs = num_envs
        self._seed = 0
        self._pool = self._make(self._seed)
        obs_space = self._pool.observation_space
        self._squeeze = isinstance(obs_space, gym.spaces.Box) and len(obs_space.shape) == 3 and obs_space.shape[0] == 1
        if self._squeeze:
            obs_space = gym.spaces.Box(obs_space.low[0], obs_space.high[0], obs_space.shape[1:], obs_space.dtype)
        self.single_observation_space = obs_space
        self.single_action_space = self._pool.action_space
        self.observation_space = gym.vector.utils.batch_space(obs_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)
        self._returns = np.zeros(num_envs)
        self._lengths = np.zeros(num_envs, dtype=np.int64)
        self._resetting = np.zeros(num_envs, dtype=bool)  # the next step is the autoreset step

    def _make(self, seed: int):
        envpool = _envpool()
        try:
            return envpool.make(self.task_id, env_type="gymnasium", num_envs=self.num_envs, seed=seed, **self._kwargs)
        except Exception as exc:  # EnvPool refuses an unknown or bad option with its own error types
            raise SetupError(
                f"EnvPool's {self.task_id} rejected env.kwargs {shown(self._kwargs)}: "
                f"{type(exc).__name__}: {one_line(str(exc))[:300]} (env.kwargs are EnvPool's options under "
                "env.vectorization=envpool)"
            ) from None

    def _obs(self, obs: np.ndarray) -> np.ndarray:
        return obs[:, 0] if self._squeeze else obs

    def reset(self, *, seed: int | list[int] | None = None, options: dict | None = None):
        """Reset every env; a new ``seed`` remakes the pool (EnvPool seeds its envs when it makes
        them: env i with ``seed + i``, as gymnasium's vector envs do)."""
        if isinstance(seed, (list, tuple)):
            seed = seed[0]
        if seed is not None and int(seed) != self._seed:
            self._pool.close()
            self._seed = int(seed)
            self._pool = self._make(self._seed)
        obs, _ = self._pool.reset()
        self._returns[:] = 0.0
        self._lengths[:] = 0
        self._resetting[:] = False
        return self._obs(obs), {}

    def step(self, actions):
        obs, reward, terminated, truncated, info = self._pool.step(np.asarray(actions))
        terminated, truncated = np.asarray(terminated), np.asarray(truncated)
        raw = np.asarray(info.get("reward", reward), dtype=np.float64)
        real = ~self._resetting
        self._returns += np.where(real, raw, 0.0)
        self._lengths += real
        ended = terminated | truncated
        done = ended & real
        out: dict[str, Any] = {}
        if done.any():
            out[RAW_EPISODE_KEY] = {"r": np.where(done, self._returns, 0.0), "l": np.where(done, self._lengths, 0)}
            out["_" + RAW_EPISODE_KEY] = done
            self._returns[done] = 0.0
            self._lengths[done] = 0
        self._resetting = ended
        return self._obs(obs), np.asarray(reward), terminated, truncated, out

    def close_extras(self, **kwargs: Any) -> None:
        self._pool.close()
