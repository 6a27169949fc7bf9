"""The passive T-Maze (rl_replay/PassiveTMaze-v0): timeline, rewards and the memory it needs."""

import warnings

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from rl_replay.envs import PassiveTMazeEnv
from rl_replay.envs.tmaze import DOWN, LEFT, RIGHT, UP


def play(env, policy, seed):
    """Run one episode; ``policy(t, obs, first_obs)`` picks each action."""
    obs, _ = env.reset(seed=seed)
    first, t, observations, rewards = obs, 0, [obs], []
    while True:
        obs, reward, terminated, truncated, info = env.step(policy(t, obs, first))
        observations.append(obs)
        rewards.append(reward)
        t += 1
        if terminated or truncated:
            return observations, rewards, info, terminated, truncated


def remembering(t, obs, first):
    """The optimal policy: right along the corridor, then the side seen at step 0."""
    if obs[0] == 1.0:
        return UP if first[1] > 0 else DOWN
    return RIGHT


@pytest.mark.parametrize("length", [1, 2, 7])
@pytest.mark.parametrize("seed", range(4))
def test_optimal_policy(length, seed):
    env = PassiveTMazeEnv(corridor_length=length)
    observations, rewards, info, terminated, truncated = play(env, remembering, seed)
    assert terminated and not truncated and info == {"success": True}
    assert len(rewards) == length + 1
    assert rewards == [0.0] * length + [1.0]
    acted_on = observations[:-1]
    # The side is visible at step 0 only; the junction flag only where the turn is made.
    assert acted_on[0][1] in (-1.0, 1.0) and all(o[1] == 0.0 for o in acted_on[1:])
    assert [o[0] for o in acted_on] == [0.0] * length + [1.0]


def test_both_sides_occur_and_the_wrong_turn_fails():
    env = PassiveTMazeEnv(corridor_length=3)
    sides, failures = set(), 0
    for seed in range(16):
        sides.add(float(env.reset(seed=seed)[0][1]))
        wrong = lambda t, o, f: (DOWN if f[1] > 0 else UP) if o[0] == 1.0 else RIGHT  # noqa: E731
        _, rewards, info, _, _ = play(env, wrong, seed)
        failures += not info["success"] and rewards[-1] == 0.0
    assert sides == {-1.0, 1.0} and failures == 16


def test_falling_behind_is_penalised_every_step_and_misses_the_junction():
    length = 5
    env = PassiveTMazeEnv(corridor_length=length)
    # Wait once (left into the wall at x = 0), then walk right: one step behind from then on.
    policy = lambda t, o, f: LEFT if t == 0 else (UP if o[0] == 1.0 else RIGHT)  # noqa: E731
    observations, rewards, info, terminated, _ = play(env, policy, seed=0)
    assert terminated and info == {"success": False}
    np.testing.assert_allclose(rewards, [-1 / length] * length + [0.0])
    assert all(o[0] == 0.0 for o in observations[:-1])  # never reached the junction in time
    # The sum of penalties is at least -1 (the paper's scaling) whatever the agent does.
    assert sum(rewards) >= -1.0 - 1e-12


def test_walls_hold_the_agent():
    env = PassiveTMazeEnv(corridor_length=3, penalty=-0.5)
    env.reset(seed=0)
    obs, reward, *_ = env.step(UP)  # no side corridor at x = 0
    assert list(obs) == [0.0, 0.0] and reward == -0.5
    env.step(RIGHT)
    obs, reward, *_ = env.step(RIGHT)  # x = 2 after three steps: still behind, not at the junction
    assert list(obs) == [0.0, 0.0] and reward == -0.5
    obs, reward, terminated, _, info = env.step(DOWN)  # no side corridor at x = 2 either
    assert terminated and reward == 0.0 and info == {"success": False}


def test_registered_and_checked():
    env = gymnasium.make("rl_replay/PassiveTMaze-v0", corridor_length=4)
    assert env.spec.max_episode_steps is None and env.unwrapped.corridor_length == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(PassiveTMazeEnv(corridor_length=4), skip_render_check=True)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"corridor_length": 0}, "corridor_length must be >= 1"),
        ({"corridor_length": 2.5}, "corridor_length must be an int"),
        ({"penalty": 0.1}, "penalty must be <= 0"),
        ({"goal_reward": float("nan")}, "goal_reward must be finite"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PassiveTMazeEnv(**kwargs)


def test_step_outside_an_episode():
    env = PassiveTMazeEnv(corridor_length=1)
    with pytest.raises(RuntimeError, match="before reset"):
        env.step(RIGHT)
    env.reset(seed=0)
    env.step(RIGHT)
    env.step(UP)
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step(RIGHT)
    env.reset(seed=0)
    with pytest.raises(ValueError, match="not in Discrete"):
        env.step(4)


# --------------------------------------------------------------------------- PreviousActionReward


def test_previous_action_reward_wrapper():
    from rl_replay.envs.wrappers import PreviousActionReward

    env = PreviousActionReward(PassiveTMazeEnv(corridor_length=2), reward_scale=2.0)
    assert env.observation_space.shape == (2 + 4 + 1,)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (7,) and not obs[2:].any()  # nothing before the first action
    obs, reward, *_ = env.step(LEFT)  # into the wall: behind, penalty -1/2
    np.testing.assert_array_equal(obs, [0, 0, 0, 0, 1, 0, 2.0 * reward])
    assert reward == -0.5
    obs, *_ = env.reset(seed=1)
    assert not obs[2:].any()  # a reset clears the previous action and reward

    only_reward = PreviousActionReward(PassiveTMazeEnv(corridor_length=2), action=False)
    only_reward.reset(seed=0)
    obs, reward, *_ = only_reward.step(RIGHT)
    assert obs.shape == (3,) and obs[-1] == reward == 0.0
    # Only the checker's notices that this is a wrapper and that a reward has no finite bound.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(PreviousActionReward(PassiveTMazeEnv(corridor_length=3)), skip_render_check=True)
    expected = ("different from the unwrapped", "infinity")
    assert all(any(e in str(w.message) for e in expected) for w in caught), [str(w.message) for w in caught]


def test_previous_action_reward_refuses_what_it_cannot_extend():
    from rl_replay.envs.wrappers import PreviousActionReward

    with pytest.raises(ValueError, match="Discrete action space"):
        PreviousActionReward(gymnasium.make("Pendulum-v1"))
    image = gymnasium.make("rl_replay/MemoryCue-v0")
    image.observation_space = gymnasium.spaces.Box(0, 255, (4, 4, 3), np.uint8)
    with pytest.raises(ValueError, match="1-D Box observation space"):
        PreviousActionReward(image)
