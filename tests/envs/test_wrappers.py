"""rl_replay.envs.wrappers.ActionSubset: the agent's index picks one of the listed actions."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest

from rl_replay.envs.tmaze import PassiveTMazeEnv
from rl_replay.envs.wrappers import ActionSubset


def test_action_subset_steps_the_listed_actions():
    env = ActionSubset(PassiveTMazeEnv(corridor_length=20), actions=[3, 0])
    plain = PassiveTMazeEnv(corridor_length=20)
    assert env.action_space == gymnasium.spaces.Discrete(2)
    obs, _ = env.reset(seed=3)
    want, _ = plain.reset(seed=3)
    np.testing.assert_array_equal(obs, want)
    for index in (1, 1, 0, 1, 0, 0):  # the same trajectory as stepping [3, 0][index] (DOWN, RIGHT) directly
        got = env.step(index)
        expected = plain.step([3, 0][index])
        np.testing.assert_array_equal(got[0], expected[0])
        assert got[1:4] == expected[1:4]
    # numpy integers (what a vector env hands each sub-env) index the list too
    assert env.action(np.int64(0)) == 3 and env.action(np.array(1)) == 0


@pytest.mark.parametrize("actions", [[], [0, 0], [4], [-1], [1.0], [True], [[0, 1]]])
def test_action_subset_refuses_actions_outside_the_space(actions):
    with pytest.raises(ValueError, match="distinct integers of the env's action space"):
        ActionSubset(PassiveTMazeEnv(corridor_length=4), actions=actions)


def test_action_subset_needs_a_discrete_space():
    with pytest.raises(ValueError, match="Discrete action space"):
        ActionSubset(gymnasium.make("Pendulum-v1"))
