"""Wrappers for third-party environments, for ``env.wrappers``."""

from __future__ import annotations

import gymnasium as gym

__all__ = ["SuccessOnReward"]


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
