"""Passive T-Maze (Ni et al. 2023, "When do Transformers Shine in RL? Decoupling Memory from
Credit Assignment", after Bakker 2001): walk a corridor, then turn towards a side shown only
at the start.

Map, for a corridor of length ``L``::

                 up goal  (x = L, y = +1)
    x=0 ----------- x=L   (the junction)
                 down goal (x = L, y = -1)

The agent starts at ``x = 0`` ("passive": it is placed on the oracle cell, it does not have to
go and look). An episode is exactly ``L + 1`` actions: ``L`` steps right to reach the junction,
then one turn. So the side seen at step 0 must be remembered across ``L`` steps, the memory
length of the paper's figure 2 (their longest solved passive length is 1,500).
"""

from __future__ import annotations

import gymnasium
import numpy as np
from gymnasium import spaces

from .memory import _check_finite, _check_int

RIGHT, UP, LEFT, DOWN = 0, 1, 2, 3
_MOVES = {RIGHT: (1, 0), UP: (0, 1), LEFT: (-1, 0), DOWN: (0, -1)}


class PassiveTMazeEnv(gymnasium.Env):
    """The passive T-Maze of Ni et al. 2023 with ambiguous positions.

    Observation: float32 ``[junction_flag, side]`` in [-1, 1]:

    - step 0, returned by ``reset()``: ``[0, goal]`` with ``goal`` = +1 (up) or -1 (down);
    - on the corridor (``0 <= x < L``) afterwards: ``[0, 0]``, the same everywhere, so the
      position is not observed either;
    - at the junction (``x = L``): ``[1, 0]``.

    Action: ``Discrete(4)``, 0 right, 1 up, 2 left, 3 down. A move into a wall (left at
    ``x = 0``, up or down off the junction, right at the junction) leaves the agent where it is.

    Reward (the paper's structure): after each of the first ``L`` actions, ``penalty`` (default
    ``-1 / L``) if the agent is behind the schedule ``x = t`` of an agent that walks right every
    step, else 0; the ``L``-step sum of penalties lies in [-1, 0]. After the last action (the
    ``L + 1``-th) the episode terminates with ``goal_reward`` (1.0) if the agent is on the goal
    cell, else 0, and ``info["success"]``. Falling behind once means missing the junction, so
    success needs ``L`` moves right and then the remembered turn; the optimal return is
    ``goal_reward``.

    All randomness (the goal side) comes from ``self.np_random``, seeded by ``reset(seed=...)``.
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        corridor_length: int = 10,
        penalty: float | None = None,
        goal_reward: float = 1.0,
        render_mode: str | None = None,
    ):
        self.corridor_length = _check_int("corridor_length", corridor_length, 1)
        self.penalty = -1.0 / self.corridor_length if penalty is None else _check_finite("penalty", penalty)
        if self.penalty > 0:
            raise ValueError(f"penalty must be <= 0 (it punishes falling behind), got {penalty!r}")
        self.goal_reward = _check_finite("goal_reward", goal_reward)
        if render_mode is not None:
            raise ValueError(f"render_mode is not supported, got {render_mode!r}")
        self.render_mode = render_mode
        self.observation_space = spaces.Box(low=-1.0, high=1.0, shape=(2,), dtype=np.float32)
        self.action_space = spaces.Discrete(4)
        self._t: int | None = None  # actions taken so far; None before reset and after the end
        self._x = self._y = self._goal = 0

    def _obs(self, side: float = 0.0) -> np.ndarray:
        return np.array([1.0 if self._x == self.corridor_length else 0.0, side], dtype=np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self._goal = 1 if self.np_random.integers(2) else -1
        self._t, self._x, self._y = 0, 0, 0
        return self._obs(side=float(self._goal)), {}

    def step(self, action):
        if self._t is None:
            raise RuntimeError("PassiveTMazeEnv.step() called before reset() or after the episode ended")
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is not in {self.action_space}")
        dx, dy = _MOVES[int(action)]
        x, y = self._x + dx, self._y + dy
        on_corridor = y == 0 and 0 <= x <= self.corridor_length
        on_goal_cell = x == self.corridor_length and abs(y) == 1
        if on_corridor or (on_goal_cell and self._y == 0):
            self._x, self._y = x, y
        self._t += 1

        if self._t <= self.corridor_length:
            reward = self.penalty if self._x < self._t else 0.0
            return self._obs(), reward, False, False, {}
        success = self._y == self._goal
        self._t = None  # the episode is over; force a reset before the next step
        return self._obs(), self.goal_reward if success else 0.0, True, False, {"success": success}
