"""Non-finite guards in the trainer: divergence stops before the step, bad updates are skipped within budget, PPO steps and env outputs are guarded."""

from __future__ import annotations

import json
import re

import gymnasium as gym
import numpy as np
import pytest
import torch
from _runs import (
    tiny,
)

from rl_replay.errors import NonFiniteError
from rl_replay.run.setup import build
from rl_replay.rundir.checkpoint import checkpoint_path, load_checkpoint


def test_divergence_stops_before_the_step_naming_update_term_and_checkpoint(tmp_path):
    run = tmp_path / "run"
    trainer = build(tiny(run, 40, "optim.name=sgd", "optim.lr=1e3", "optim.max_grad_norm=null", "checkpoint.every=1"))
    with pytest.raises(NonFiniteError) as info:
        trainer.train()
    message = str(info.value)
    state = load_checkpoint(run)
    print(message)
    assert re.match(rf"update {state['update'] + 1}: ", message)
    assert re.search(r"(loss term train/\w+|gradient of [\w.]+|parameter [\w.]+) is (nan|inf|-inf)", message)
    assert f"last good checkpoint: {checkpoint_path(run)} (update {state['update']})" in message
    assert all(torch.isfinite(t).all() for t in state["agent"].values())
    assert not trainer.lock.held  # released: the run can be resumed or inspected


def test_trainer_skips_bad_updates_within_budget(tmp_path, capsys):
    trainer = build(
        tiny(
            tmp_path / "run",
            40,
            "optim.name=sgd",
            "optim.lr=1e3",
            "optim.max_grad_norm=null",
            "optim.skip_nonfinite_updates=2",
        )
    )
    with pytest.raises(NonFiniteError):
        trainer.train()
    warnings = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning: update")]
    assert len(warnings) == 2 and trainer.guard.budget.skipped == 2
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1]["train/skipped_updates"] == 2


def test_ppo_steps_are_guarded_too(tmp_path, capsys):
    # PPO makes several optimizer steps per update: each goes through the same guard, so a
    # skipped minibatch step is counted and the weights never become non-finite.
    trainer = build(
        tiny(
            tmp_path / "run",
            40,
            "loss.algorithm=ppo",
            "ppo.num_minibatches=1",
            "ppo.epochs=2",
            "optim.name=sgd",
            "optim.lr=1e3",
            "optim.max_grad_norm=null",
            "optim.skip_nonfinite_updates=1",
        )
    )
    with pytest.raises(NonFiniteError, match=r"stopped before the optimizer step"):
        trainer.train()
    assert trainer.guard.budget.skipped == 1
    assert all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())


class NonFiniteEnv(gym.Env):
    """Finite for three steps, then a NaN reward or an infinite observation."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, shape=(3,), dtype=np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, bad="reward"):
        self.bad, self.t = bad, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(3, dtype=np.float32), {}

    def step(self, action):
        self.t += 1
        obs = np.zeros(3, dtype=np.float32)
        reward = 1.0
        if self.t >= 3:
            if self.bad == "reward":
                reward = float("nan")
            else:
                obs[1] = np.inf
        return obs, reward, False, False, {}


if "test_safety/NonFinite-v0" not in gym.registry:
    gym.register(id="test_safety/NonFinite-v0", entry_point=NonFiniteEnv, max_episode_steps=50)


@pytest.mark.parametrize("bad, what", [("reward", "reward (nan)"), ("observation", "observation")])
def test_env_non_finite_output_is_named(tmp_path, bad, what):
    trainer = build(tiny(tmp_path / "run", 4, "env.id=test_safety/NonFinite-v0", f"env.kwargs={{bad: {bad}}}"))
    with pytest.raises(
        NonFiniteError,
        match=rf"environment 'test_safety/NonFinite-v0' returned a non-finite "
        rf"{re.escape(what)} in sub-env 0",
    ):
        trainer.train()
