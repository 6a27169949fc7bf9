"""Wrappers for third-party environments, for ``env.wrappers``."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium import spaces

__all__ = ["ActionSubset", "PreviousAction", "PreviousActionReward", "SuccessOnReward"]


class SuccessOnReward(gym.Wrapper):
    """Sets ``info["success"]`` when an episode ends: whether it terminated on a positive reward.

    MiniGrid's tasks pay ``1 - 0.9 * steps / max_steps`` for reaching the goal and 0 for a wrong
    choice or a time-out, and report no success flag; with this wrapper the trainer's
    ``rollout/success_rate`` and the evaluation's ``success_rate`` count solved episodes.
    """

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        if terminated or truncated:
            info = {**info, "success": bool(terminated and reward > 0)}
        return obs, reward, terminated, truncated, info


class ActionSubset(gym.ActionWrapper):
    """Keeps only ``actions`` of a ``Discrete`` action space: the agent picks an index into the
    list, the env receives the listed action.

    MiniGrid's tasks expose seven actions (left, right, forward, pickup, drop, toggle, done) where
    a navigation task such as ``MiniGrid-MemoryS7-v0`` needs the first three; the other four only
    spend steps, and a uniform early policy wastes four sevenths of its exploration on them (the
    recurrent PPO baselines of Pleines et al. on MiniGrid Memory use the same three actions).
    """

    def __init__(self, env: gym.Env, actions: list[int] | tuple[int, ...] = (0, 1, 2)):
        super().__init__(env)
        space = env.action_space
        if not isinstance(space, spaces.Discrete):
            raise ValueError(f"ActionSubset needs a Discrete action space, got {space}")
        actions = list(actions)
        valid = range(int(space.start), int(space.start + space.n))
        integers = all(isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in actions)
        if not (actions and integers and len(set(actions)) == len(actions) and all(a in valid for a in actions)):
            raise ValueError(
                f"ActionSubset actions must be distinct integers of the env's action space "
                f"{space} (from {valid.start} to {valid.stop - 1}), got {actions}"
            )
        self.actions = np.asarray(actions, dtype=np.int64)
        self.action_space = spaces.Discrete(len(actions))

    def action(self, action):
        return int(self.actions[int(action)])


class PreviousActionReward(gym.Wrapper):
    """Appends the previous action (one-hot) and ``reward_scale`` times the previous reward to a
    flat Box observation, both 0 after a reset: the input of the recurrent agents of Ni et al.
    2023 (and RL^2, R2D2), which lets a policy whose observation is ambiguous see what its own
    actions did (for example whether it fell behind in the T-Maze).

    ``action=False`` appends the reward only. Needs a ``Discrete`` action space (when
    ``action``) and a 1-D ``Box`` observation space.
    """

    def __init__(self, env: gym.Env, reward_scale: float = 1.0, action: bool = True):
        super().__init__(env)
        if action and not isinstance(env.action_space, spaces.Discrete):
            raise ValueError(f"PreviousActionReward needs a Discrete action space, got {env.action_space}")
        space = env.observation_space
        if not (isinstance(space, spaces.Box) and len(space.shape) == 1):
            raise ValueError(f"PreviousActionReward needs a 1-D Box observation space, got {space}")
        self._n = int(env.action_space.n) if action else 0
        self.reward_scale = float(reward_scale)
        self.observation_space = spaces.Box(
            low=np.concatenate([space.low, np.zeros(self._n), [-np.inf]]).astype(space.dtype),
            high=np.concatenate([space.high, np.ones(self._n), [np.inf]]).astype(space.dtype),
            dtype=space.dtype,
        )

    def _extend(self, obs, action, reward):
        extra = np.zeros(self._n + 1, dtype=self.observation_space.dtype)
        if action is not None:
            if self._n:
                extra[int(action)] = 1.0
            extra[-1] = self.reward_scale * reward
        return np.concatenate([obs, extra])

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return self._extend(obs, None, 0.0), info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return self._extend(obs, action, reward), reward, terminated, truncated, info


class PreviousAction(gym.Wrapper):
    """The observation as a Dict: ``obs`` (the env's), ``prev_action`` (the action that led to it;
    the lowest action after a reset) and, with ``is_first``, ``is_first`` (``Discrete(2)``, 1 on
    an episode's first observation).

    POPGym's experiments wrap every env in ``Antialias(PreviousAction(env))``, the same two
    inputs as a Tuple; POPGym's wrappers accept only a bare POPGym env, where this one wraps any
    env (``gym.make`` adds its own wrappers first). Without ``is_first`` the null action after a
    reset looks like a real one. Action spaces: ``Discrete``, ``MultiDiscrete``, ``MultiBinary``
    or ``Box``.
    """

    def __init__(self, env: gym.Env, is_first: bool = True):
        super().__init__(env)
        act = env.action_space
        if not isinstance(act, (spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary, spaces.Box)):
            raise ValueError(
                f"PreviousAction needs a Discrete, MultiDiscrete, MultiBinary or Box action space, got {act}"
            )
        if isinstance(env.observation_space, spaces.Dict):
            raise ValueError(
                "PreviousAction wraps an env whose observation is not already a Dict, got "
                f"{env.observation_space}: add the previous action as a key of that Dict in the env instead"
            )
        parts: dict[str, spaces.Space] = {"obs": env.observation_space, "prev_action": act}
        if is_first:
            parts["is_first"] = spaces.Discrete(2)
        self.observation_space = spaces.Dict(parts)
        self.is_first = is_first
        if isinstance(act, spaces.Discrete):
            self._null = act.start
        elif isinstance(act, spaces.MultiDiscrete):
            self._null = np.array(act.start, dtype=act.dtype)
        elif isinstance(act, spaces.MultiBinary):
            self._null = np.zeros(act.shape, act.dtype)
        else:
            self._null = np.clip(np.zeros(act.shape, act.dtype), act.low, act.high)

    def _observation(self, obs, action, first: bool) -> dict:
        out = {"obs": obs, "prev_action": action}
        if self.is_first:
            out["is_first"] = int(first)
        return out

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return self._observation(obs, self._null, True), info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return self._observation(obs, action, False), reward, terminated, truncated, info
