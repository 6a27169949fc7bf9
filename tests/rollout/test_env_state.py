"""rl_replay/rollout/env_state.py and the env part of checkpoints: wrapper state survives a resume.

The shipped showcase's wrappers (RescaleObservation, whose closure plain pickle refuses,
plus NormalizeObservation / NormalizeReward) pickle and come back with their statistics; a
resumed run of that config reproduces the uninterrupted run's metrics row for row; pooled
statistics equal those of the concatenated data; evaluation uses the training statistics,
frozen; an async run resumes with its statistics and says in one line that its episodes
start over.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from rl_replay.agents.mlp import MLPAgent
from rl_replay.config import load_config
from rl_replay.errors import SetupError
from rl_replay.rollout.env_state import (
    pickle_envs,
    pool_statistics,
    training_statistics,
    vector_statistics,
    wrapper_statistics,
)
from rl_replay.run.evaluate import evaluate
from rl_replay.run.logger import read_metrics
from rl_replay.run.setup import build
from rl_replay.rundir.checkpoint import load_checkpoint
from rl_replay.targets import unpickle

REPO = Path(__file__).resolve().parents[2]
NORMALIZING = (
    'env.wrappers=[{target: "gymnasium.wrappers:RescaleObservation", kwargs: {min_obs: -2.0, max_obs: 2.0}}, '
    '{target: "gymnasium.wrappers:NormalizeObservation"}, '
    '{target: "gymnasium.wrappers:NormalizeReward", kwargs: {gamma: 0.995}}]'
)


def wrapped_env(seed=0):
    import rl_replay.envs  # noqa: F401  (registers rl_replay/POCartPole-v0, a bounded Box)

    env = gym.make("rl_replay/POCartPole-v0")
    env = gym.wrappers.RescaleObservation(env, -2.0, 2.0)
    env = gym.wrappers.NormalizeObservation(env)
    env = gym.wrappers.NormalizeReward(env, gamma=0.99)
    env.reset(seed=seed)
    for _ in range(30):
        if any(env.step(env.action_space.sample())[2:4]):
            env.reset()
    return env


def test_wrappers_holding_local_functions_pickle_with_their_state():
    env = wrapped_env()
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError), match="local"):
        pickle.dumps(env)  # what the checkpoint met before: rescale_box.<locals>.forward
    copy = unpickle(pickle_envs(env))
    assert [type(w).__name__ for w in (copy, copy.env, copy.env.env)] == [
        "NormalizeReward",
        "NormalizeObservation",
        "RescaleObservation",
    ]
    for ours, theirs in zip(wrapper_statistics(env), wrapper_statistics(copy)):
        assert ours["attr"] == theirs["attr"] and ours["count"] == theirs["count"] > 1
        np.testing.assert_array_equal(ours["mean"], theirs["mean"])
    # Both continue identically: same env state, same RNG, same statistics, same rescaling.
    for action in [0, 1, 1, 0, 1]:
        a, b = env.step(action), copy.step(action)
        np.testing.assert_array_equal(a[0], b[0])
        assert a[1:4] == b[1:4]


def test_pooled_statistics_equal_those_of_the_concatenated_data():
    rng = np.random.default_rng(0)
    parts = [rng.normal(loc, 1.0 + loc, size=(n, 3)) for loc, n in ((0.0, 50), (2.0, 20), (-1.0, 70))]
    per_env = []
    for x in parts:
        rms = gym.wrappers.utils.RunningMeanStd(shape=(3,))
        for row in x:
            rms.update(row[None])
        per_env.append([{"wrapper": "w", "attr": "obs_rms", "mean": rms.mean, "var": rms.var, "count": rms.count}])
    (pooled,) = pool_statistics(per_env)
    data = np.concatenate(parts)
    np.testing.assert_allclose(pooled["mean"], data.mean(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(pooled["var"], data.var(0), rtol=1e-4, atol=1e-4)
    assert pooled["count"] == pytest.approx(len(data), abs=1e-3)


def pocartpole_cfg(run_dir, updates, *extra):
    # configs/ppo_pocartpole_gru.yaml shortened, with NormalizeObservation added to its wrappers.
    return load_config(
        REPO / "configs" / "ppo_pocartpole_gru.yaml",
        [
            "env.num_envs=4",
            "collector.num_steps=16",
            "ppo.epochs=2",
            f"total_env_steps={updates * 64}",
            "optim.anneal_lr=false",
            "checkpoint.every=0",
            "log.progress=false",
            "log.wandb_mode=disabled",
            f"run_dir={run_dir}",
            NORMALIZING,
            *extra,
        ],
    )


COMPARED = ("rollout/", "train/", "loss/")


def compared(rows):
    return [{k: v for k, v in r.items() if k.startswith(COMPARED) or k in ("update", "env_steps")} for r in rows]


def test_resumed_normalizing_run_reproduces_the_uninterrupted_run_row_for_row(tmp_path):
    build(pocartpole_cfg(tmp_path / "full", 12)).train()
    with warnings.catch_warnings():
        # Neither "environments cannot be pickled" nor "holds no environment state" any more.
        warnings.filterwarnings("error", message=".*(cannot be pickled|no environment state)")
        build(pocartpole_cfg(tmp_path / "part", 5)).train()
        resumed = build(resume=tmp_path / "part", overrides=(f"total_env_steps={12 * 64}",))
    resumed.train()
    full, part = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "part")
    assert len(full) == len(part) == 12
    assert any(r["rollout/episodes"] for r in full[5:])  # episodes ended after the resume
    assert compared(part) == compared(full)
    a, b = load_checkpoint(tmp_path / "full"), load_checkpoint(tmp_path / "part")
    for x, y in zip(training_statistics(a["collector"]), training_statistics(b["collector"])):
        assert x["count"] == y["count"] and np.array_equal(x["mean"], y["mean"])


class RecordingAgent(MLPAgent):
    """Keeps the observations its forward saw (evaluation only: no replay)."""

    def forward(self, observation, state, is_first):
        self.seen.append(observation.clone())
        return super().forward(observation, state, is_first)


def test_evaluation_uses_the_given_statistics_frozen():
    spec = [{"target": "gymnasium.wrappers:NormalizeObservation"}]
    probe = gym.vector.SyncVectorEnv([lambda: gym.wrappers.NormalizeObservation(gym.make("CartPole-v1"))])
    agent = RecordingAgent(probe.single_observation_space, probe.single_action_space, hidden_sizes=[8])
    agent.seen = []
    (entry,) = wrapper_statistics(probe.envs[0])
    probe.close()
    # Far from CartPole's observations and with a small count: updated statistics would move
    # to the data within a few steps and the agent would see inputs near 0.
    stats = [dict(entry, mean=np.full(4, 100.0), var=np.ones(4), count=10.0)]
    evaluate(agent, "CartPole-v1", episodes=4, num_envs=2, env_wrappers=spec, env_statistics=stats)
    seen = torch.cat(agent.seen)
    assert len(agent.seen) > 5 and bool((seen < -90).all())
    with pytest.raises(
        SetupError, match=r"^the checkpoint's environment statistics \(\['obs_rms'\]\) do not fit .* \(\[\]\)"
    ):
        evaluate(agent, "CartPole-v1", episodes=1, num_envs=1, env_statistics=stats)


def test_evaluate_cli_reads_the_training_statistics(tmp_path):
    run = tmp_path / "run"
    build(
        load_config(
            None,
            [
                "env.num_envs=2",
                "collector.num_steps=8",
                "total_env_steps=160",
                "agent.kwargs={hidden_sizes: [8]}",
                "log.progress=false",
                "log.wandb_mode=disabled",
                f"run_dir={run}",
                'env.wrappers=[{target: "gymnasium.wrappers:NormalizeObservation"}]',
            ],
        )
    ).train()
    (stats,) = training_statistics(load_checkpoint(run)["collector"])
    assert stats["attr"] == "obs_rms" and stats["count"] == pytest.approx(2 * (80 + 1) + 1e-4, abs=5)
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "evaluate.py"), str(run), "--episodes", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "over 2 episodes" in proc.stdout


def test_async_resume_restores_the_statistics_and_says_episodes_start_over(tmp_path):
    extra = (
        "env.vectorization=async",
        "env.num_envs=2",
        "collector.num_steps=8",
        "optim.anneal_lr=false",
        "agent.kwargs={hidden_sizes: [8]}",
        "log.progress=false",
        "log.wandb_mode=disabled",
        'env.wrappers=[{target: "gymnasium.wrappers:NormalizeObservation"}]',
    )
    build(load_config(None, [*extra, "total_env_steps=160", f"run_dir={tmp_path / 'run'}"])).train()
    saved = load_checkpoint(tmp_path / "run")["collector"][0]["env_statistics"]
    assert [s[0]["count"] for s in saved] == [
        pytest.approx(82, abs=1e-3)
    ] * 2  # 80 steps, 2 resets (probe, first rollout)
    with pytest.warns(UserWarning) as caught:
        resumed = build(resume=tmp_path / "run", overrides=("total_env_steps=320",))
    try:
        (message,) = [str(w.message) for w in caught if "environment state" in str(w.message)]
        assert message.startswith(
            "the checkpoint holds no environment state (env.vectorization=async): the "
            "resumed run starts fresh episodes with the saved wrapper statistics"
        )
        assert "\n" not in message
        now = vector_statistics(resumed.collector.envs)
        # The saved count plus the fresh episodes' first observation.
        assert [s[0]["count"] for s in now] == [pytest.approx(s[0]["count"] + 1) for s in saved]
    finally:
        resumed.close()
        resumed.collector.envs.close()
