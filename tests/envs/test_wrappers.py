"""rl_replay.envs.wrappers: ActionSubset (the agent's index picks one of the listed actions) and PreviousAction
(the previous action and the episode's first step beside the observation)."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest

from rl_replay.envs.tmaze import PassiveTMazeEnv
from rl_replay.envs.wrappers import ActionSubset, PreviousAction


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


def test_previous_action_adds_the_last_action_and_the_first_step_flag():
    env = PreviousAction(gymnasium.make("CartPole-v1"))
    plain = gymnasium.make("CartPole-v1")
    assert set(env.observation_space.spaces) == {"obs", "prev_action", "is_first"}
    assert env.observation_space["prev_action"] == plain.action_space
    obs, _ = env.reset(seed=5)
    want, _ = plain.reset(seed=5)
    np.testing.assert_array_equal(obs["obs"], want)
    assert (obs["prev_action"], obs["is_first"]) == (0, 1)  # the null action is the lowest one
    for action in (1, 1, 0, 1):
        obs, reward, terminated, truncated, _ = env.step(action)
        expected = plain.step(action)
        np.testing.assert_array_equal(obs["obs"], expected[0])
        assert (reward, terminated, truncated) == expected[1:4]
        assert (obs["prev_action"], obs["is_first"]) == (action, 0)
        assert env.observation_space.contains(obs)
    obs, _ = env.reset(seed=6)
    assert (obs["prev_action"], obs["is_first"]) == (0, 1)  # a new episode starts clean


def test_previous_action_without_the_flag_and_with_other_action_spaces():
    env = PreviousAction(gymnasium.make("Pendulum-v1"), is_first=False)
    assert set(env.observation_space.spaces) == {"obs", "prev_action"}
    obs, _ = env.reset(seed=0)
    np.testing.assert_array_equal(obs["prev_action"], np.zeros(1, np.float32))  # 0 lies inside [-2, 2]
    obs, *_ = env.step(np.array([1.5], np.float32))
    np.testing.assert_array_equal(obs["prev_action"], [1.5])
    assert env.observation_space.contains(obs)


def test_previous_action_refuses_a_dict_observation():
    with pytest.raises(ValueError, match="not already a Dict"):
        PreviousAction(PreviousAction(gymnasium.make("CartPole-v1")))


class _MultiDiscreteActions(gymnasium.Env):
    """A one-step env whose actions are MultiDiscrete with a non-zero start."""

    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gymnasium.spaces.MultiDiscrete([3, 4], start=[1, -2])

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        return np.ones(2, np.float32), 0.0, True, False, {}


def test_previous_action_of_a_multi_discrete_space_starts_at_its_lowest_action():
    env = PreviousAction(_MultiDiscreteActions())
    obs, _ = env.reset(seed=0)
    np.testing.assert_array_equal(obs["prev_action"], [1, -2])
    assert env.observation_space.contains(obs)
    obs, *_ = env.step(np.array([3, 1]))
    np.testing.assert_array_equal(obs["prev_action"], [3, 1])
    assert env.observation_space.contains(obs) and obs["is_first"] == 0
