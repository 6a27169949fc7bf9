"""One episode bookkeeping for collection and evaluation: returns and lengths over real steps
(gymnasium's autoreset step is none), success when reported, and Box actions kept in bounds."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch

from rl_replay.agents.mlp import MLPAgent
from rl_replay.rollout.episodes import EpisodeTracker, env_action
from rl_replay.run.evaluate import evaluate


class RecordActions(gym.ActionWrapper):
    """Keeps every action that reaches the env (class-level: the vector env builds the instances)."""

    seen: list[np.ndarray] = []

    def action(self, action):
        RecordActions.seen.append(np.array(action))
        return action


def test_the_tracker_counts_real_steps_and_skips_the_autoreset_step():
    tracker = EpisodeTracker(2)
    F, T = np.array([False, False]), np.array([True, False])
    info = {"success": np.array([1.0, 0.0]), "_success": np.array([True, False])}
    ended, first = tracker.step(np.array([1.0, 2.0]), F, F, {}, tracker.real_steps())
    assert ended == [] and not first.any()
    ended, first = tracker.step(np.array([3.0, 4.0]), T, F, info, tracker.real_steps())
    assert [(e.env, e.ret, e.length, e.success) for e in ended] == [(0, 4.0, 2, 1.0)] and not first.any()
    valid = tracker.real_steps()
    assert valid.tolist() == [False, True]  # sub-env 0 takes its autoreset step
    ended, first = tracker.step(np.array([0.0, 5.0]), F, np.array([False, True]), {}, valid)
    assert [(e.env, e.ret, e.length, e.success) for e in ended] == [(1, 11.0, 3, None)]
    assert first.tolist() == [True, False]  # sub-env 0's next row starts its new episode
    assert tracker.ep_return.tolist() == [0.0, 0.0] and tracker.ep_length.tolist() == [0, 0]
    skip = np.array([True, False])
    assert tracker.real_steps(skip=skip).tolist() == [False, False]


def test_env_action_reshapes_and_clips_box_actions_and_passes_discrete_ones():
    box = gym.spaces.Box(-2.0, 2.0, shape=(1,))
    assert env_action(torch.tensor([[5.0], [-0.5], [-9.0]]), box).tolist() == [[2.0], [-0.5], [-2.0]]
    assert env_action(torch.tensor([1, 0]), gym.spaces.Discrete(2)).tolist() == [1, 0]


def test_evaluating_a_box_action_agent_keeps_its_actions_within_the_bounds():
    env = gym.make("Pendulum-v1")
    agent = MLPAgent(env.observation_space, env.action_space, hidden_sizes=[8])
    env.close()
    with torch.no_grad():  # a mean far outside [-2, 2]: what a Gaussian policy can learn or sample
        agent.head.linear.bias.fill_(10.0)
    RecordActions.seen.clear()
    for deterministic in (True, False):
        result = evaluate(
            agent,
            "Pendulum-v1",
            episodes=2,
            num_envs=2,
            deterministic=deterministic,
            max_episode_steps=20,
            env_wrappers=[{"target": f"{__name__}:RecordActions"}],
        )
        assert result["episodes"] == 2 and result["episode_length"] == 20
    actions = np.concatenate(RecordActions.seen)
    assert len(actions) >= 2 * 2 * 20 and (np.abs(actions) <= 2.0).all()
    assert (actions == 2.0).any()  # the mean of 10 was clipped, not passed on
