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


class MemoryCueVectorEnv(gymnasium.vector.VectorEnv):
    """``num_envs`` MemoryCue episodes stepped together in numpy (``env.vectorization:
    vector_entry_point``).

    The same observations, rewards, ``info["success"]`` and random numbers as a
    ``SyncVectorEnv`` of :class:`MemoryCueEnv` seeded alike: env ``i`` draws from its own
    generator, seeded ``seed + i`` by ``reset(seed=seed)``, and after an episode ends its next
    ``step`` returns the reset observation with reward 0 (gymnasium's ``NEXT_STEP`` autoreset).
    What differs is the cost: one step is a few array operations for all envs instead of a
    Python call per env, which is most of a small recurrent agent's collection time.

    Its state (episode phase, cues, generators) is plain data: :meth:`state_dict` and
    :meth:`load_state_dict` let a checkpoint resume it exactly without pickling the env.
    """

    metadata = {"render_modes": [], "autoreset_mode": gymnasium.vector.AutoresetMode.NEXT_STEP}

    def __init__(
        self,
        num_envs: int,
        delay: int = 64,
        num_cues: int = 2,
        noise_dims: int = 0,
        wrong_reward: float = -1.0,
        render_mode: str | None = None,
    ):
        self.num_envs = _check_int("num_envs", num_envs, 1)
        # One single env checks the arguments and holds the layout and the spaces.
        self._spec_env = MemoryCueEnv(delay, num_cues, noise_dims, wrong_reward, render_mode)
        self.render_mode = render_mode
        self.single_observation_space = self._spec_env.observation_space
        self.single_action_space = self._spec_env.action_space
        self.observation_space = gymnasium.vector.utils.batch_space(self.single_observation_space, self.num_envs)
        self.action_space = gymnasium.vector.utils.batch_space(self.single_action_space, self.num_envs)
        self._rngs: list[np.random.Generator | None] = [None] * self.num_envs
        self._cue = np.zeros(self.num_envs, dtype=np.int64)
        self._t = np.zeros(self.num_envs, dtype=np.int64)  # index of the observation the next action answers
        self._autoreset = np.zeros(self.num_envs, dtype=bool)
        self._started = False

    def _rng(self, i: int) -> np.random.Generator:
        if self._rngs[i] is None:  # as gymnasium.Env.np_random: seeded from the OS on first use
            self._rngs[i], _ = gymnasium.utils.seeding.np_random()
        return self._rngs[i]  # type: ignore[return-value]

    def _start_episode(self, i: int, seed: int | None = None) -> None:
        if seed is not None:
            self._rngs[i], _ = gymnasium.utils.seeding.np_random(seed)
        self._cue[i] = self._rng(i).integers(self._spec_env.num_cues)
        self._t[i] = 0

    def _observations(self) -> np.ndarray:
        env = self._spec_env
        obs = np.zeros((self.num_envs, *env.observation_space.shape), dtype=np.float32)  # type: ignore[misc]
        first = np.flatnonzero(self._t == 0)
        obs[first, self._cue[first]] = 1.0
        obs[first, env._cue_flag] = 1.0
        obs[self._t == env.delay + 1, env._query_flag] = 1.0
        if env.noise_dims:
            for i in np.flatnonzero((self._t > 0) & (self._t <= env.delay)):
                obs[i, env._noise :] = self._rng(i).uniform(-1.0, 1.0, size=env.noise_dims)
        return obs

    def reset(self, *, seed: int | list[int | None] | None = None, options: dict | None = None):
        if seed is None or isinstance(seed, (list, tuple)):
            seeds = list(seed) if seed is not None else [None] * self.num_envs
            if len(seeds) != self.num_envs:
                raise ValueError(f"reset(seed=...) needs {self.num_envs} seeds, got {len(seeds)}")
        else:
            seeds = [int(seed) + i for i in range(self.num_envs)]
        for i, s in enumerate(seeds):
            self._start_episode(i, s)
        self._autoreset[:] = False
        self._started = True
        return self._observations(), {}

    def step(self, actions):
        if not self._started:
            raise RuntimeError("MemoryCueVectorEnv.step() called before reset()")
        actions = np.asarray(actions)
        if (
            actions.shape != (self.num_envs,)
            or actions.dtype.kind not in "iu"
            or actions.min() < 0
            or actions.max() >= self._spec_env.num_cues
        ):
            raise ValueError(f"actions {actions!r} are not in {self.action_space}")
        env = self._spec_env
        rewards = np.zeros(self.num_envs, dtype=np.float64)
        terminated = np.zeros(self.num_envs, dtype=bool)
        restart = self._autoreset
        scored = ~restart & (self._t == env.delay + 1)
        success = scored & (actions == self._cue)
        rewards[scored] = np.where(success[scored], 1.0, env.wrong_reward)
        terminated[scored] = True
        self._t[~restart & ~scored] += 1
        for i in np.flatnonzero(restart):  # the step after an episode's end starts the next one
            self._start_episode(i)
        # The noise is drawn after the restarts, env by env, in the order SyncVectorEnv draws it.
        obs = self._observations()
        obs[scored] = 0.0  # the terminal observation is all zeros
        infos: dict = {}
        if scored.any():
            infos = {"success": success & scored, "_success": scored.copy()}
        self._autoreset = terminated.copy()
        return obs, rewards, terminated, np.zeros(self.num_envs, dtype=bool), infos

    def state_dict(self) -> dict:
        """The envs' state as plain data (arrays, ints, the generators' states)."""
        return {
            "cue": self._cue.copy(),
            "t": self._t.copy(),
            "autoreset": self._autoreset.copy(),
            "started": self._started,
            "rngs": [None if g is None else g.bit_generator.state for g in self._rngs],
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`."""
        if len(state["rngs"]) != self.num_envs:
            raise ValueError(f"the saved state holds {len(state['rngs'])} envs, this vector env {self.num_envs}")
        self._cue, self._t = np.array(state["cue"], dtype=np.int64), np.array(state["t"], dtype=np.int64)
        self._autoreset, self._started = np.array(state["autoreset"], dtype=bool), bool(state["started"])
        for i, rng_state in enumerate(state["rngs"]):
            if rng_state is None:
                self._rngs[i] = None
            else:
                self._rngs[i] = np.random.Generator(np.random.PCG64())
                self._rngs[i].bit_generator.state = rng_state  # type: ignore[union-attr]
