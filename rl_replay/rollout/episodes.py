"""Episodes of a vector env, step by step: one bookkeeping for collection and evaluation.

Gymnasium's vector envs reset a sub-env on the step *after* its episode ended (next-step
autoreset): that step's action is ignored and its reward is 0, so it is no step of any episode.
:class:`EpisodeTracker` counts returns and lengths over the real steps only, and reports each
finished episode with its return as the env paid it (beneath any reward wrapper,
:func:`~rl_replay.rollout.environment.env_episode_return`) and its ``success`` when the env
reports one. :func:`env_action` turns the agent's actions into what the vector env takes: Box
actions reshaped to the space and clipped to its bounds (a Gaussian sample can leave them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from rl_replay.rollout.environment import env_episode_return

__all__ = ["Episode", "EpisodeTracker", "env_action"]


@dataclass(frozen=True)
class Episode:
    """A finished episode: the sub-env it ran in, its return, length and success (None: not reported)."""

    env: int
    ret: float
    length: int
    success: float | None


class EpisodeTracker:
    """Returns and lengths of the episodes running in ``num_envs`` sub-envs.

    ``autoreset`` marks the sub-envs whose next step is gymnasium's autoreset step; ``ep_return``
    and ``ep_length`` are the running episodes' sums so far. All three are plain arrays that a
    checkpoint saves and loads as they are.
    """

    def __init__(self, num_envs: int) -> None:
        self.autoreset = np.zeros(num_envs, dtype=bool)
        self.ep_return = np.zeros(num_envs)
        self.ep_length = np.zeros(num_envs, dtype=np.int64)

    def reset(self) -> None:
        """Every sub-env starts an episode (after ``envs.reset()``)."""
        self.autoreset[:] = False
        self.ep_return[:] = 0.0
        self.ep_length[:] = 0

    def real_steps(self, skip: np.ndarray | None = None) -> np.ndarray:
        """The sub-envs whose coming step belongs to an episode: not an autoreset step, nor in ``skip``."""
        return ~self.autoreset if skip is None else ~self.autoreset & ~skip

    def step(
        self,
        reward: np.ndarray,
        terminated: np.ndarray,
        truncated: np.ndarray,
        info: dict[str, Any],
        valid: np.ndarray,
    ) -> tuple[list[Episode], np.ndarray]:
        """Count one vector step; ``valid`` is :meth:`real_steps` as it was before the step.

        Returns the episodes that ended in it (in sub-env order) and ``is_first`` of the next
        step: the sub-envs whose next step is the autoreset step (a new episode's first row).
        """
        self.ep_return += np.where(valid, reward, 0.0)
        self.ep_length += valid
        done = (terminated | truncated) & valid
        ended = []
        for i in np.flatnonzero(done):
            # Vector envs mark which sub-envs reported a key with "_<key>".
            reported = "success" in info and info.get("_success", np.ones(len(done), bool))[i]
            success = float(info["success"][i]) if reported else None
            ended.append(
                Episode(int(i), env_episode_return(info, int(i), self.ep_return[i]), int(self.ep_length[i]), success)
            )
            self.ep_return[i], self.ep_length[i] = 0.0, 0
        is_first = self.autoreset.copy()
        self.autoreset = terminated | truncated
        return ended, is_first


def env_action(action: torch.Tensor, space: gym.Space) -> np.ndarray:
    """The actions the vector env takes for the agent's batch ``action`` of ``space``
    (the single env's action space): numpy; a Box reshaped and clipped to its bounds."""
    a = action.cpu().numpy()
    if isinstance(space, gym.spaces.Box):
        a = np.clip(a.reshape((-1, *space.shape)), space.low, space.high)
    return a
