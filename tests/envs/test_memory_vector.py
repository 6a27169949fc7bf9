"""MemoryCueVectorEnv (``env.vectorization: vector_entry_point``): the same episodes as a
SyncVectorEnv of MemoryCueEnv, a state that resumes exactly as plain data, and clear refusals."""

from __future__ import annotations

import warnings
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import rl_replay.envs  # noqa: F401  (registers rl_replay/MemoryCue-v0)
from rl_replay.config import load_config
from rl_replay.errors import SetupError
from rl_replay.rollout.environment import make_vector_env
from rl_replay.run.logger import read_metrics
from rl_replay.run.setup import build
from rl_replay.rundir.checkpoint import load_checkpoint

REPO = Path(__file__).resolve().parents[2]
ID = "rl_replay/MemoryCue-v0"
KWARGS = [
    {"delay": 3},
    {"delay": 0},
    {"delay": 5, "noise_dims": 3, "num_cues": 3, "wrong_reward": -0.5},
]


def pair(n: int, **kwargs):
    own = gym.make_vec(ID, num_envs=n, vectorization_mode="vector_entry_point", **kwargs)
    sync = gym.make_vec(ID, num_envs=n, vectorization_mode="sync", **kwargs)
    return own, sync


def assert_same_step(a, b, where):
    for x, y in zip(a[:4], b[:4]):
        assert x.dtype == y.dtype and np.array_equal(x, y), (where, x, y)
    assert a[4].keys() == b[4].keys(), (where, a[4], b[4])
    for key in a[4]:
        assert a[4][key].dtype == b[4][key].dtype and np.array_equal(a[4][key], b[4][key]), (where, key)


@pytest.mark.parametrize("kwargs", KWARGS, ids=["delay3", "delay0", "noise-3cues"])
def test_the_vector_env_plays_the_sync_envs_episodes_step_for_step(kwargs):
    own, sync = pair(5, **kwargs)
    assert own.single_observation_space == sync.single_observation_space
    assert own.single_action_space == sync.single_action_space
    assert own.metadata["autoreset_mode"] == sync.metadata["autoreset_mode"]
    assert np.array_equal(own.reset(seed=7)[0], sync.reset(seed=7)[0])
    rng = np.random.default_rng(0)
    successes = 0
    for t in range(80):
        actions = rng.integers(kwargs.get("num_cues", 2), size=5)
        a, b = own.step(actions), sync.step(actions)
        assert_same_step(a, b, t)
        successes += int(a[4].get("success", np.zeros(5, bool)).sum())
        if t == 40:  # a reset without a seed continues every env's generator
            assert np.array_equal(own.reset()[0], sync.reset()[0])
    assert successes > 0  # episodes ended, some scored, and the autoreset steps matched too


def test_the_saved_state_continues_exactly_in_a_fresh_vector_env():
    kwargs = {"delay": 4, "noise_dims": 2}
    first, _ = pair(3, **kwargs)
    first.reset(seed=3)
    rng = np.random.default_rng(1)
    for _ in range(7):  # mid-episode, an autoreset pending for some envs
        first.step(rng.integers(2, size=3))
    saved = first.state_dict()
    second = gym.make_vec(ID, num_envs=3, vectorization_mode="vector_entry_point", **kwargs)
    second.load_state_dict(saved)
    for t in range(20):
        actions = rng.integers(2, size=3)
        assert_same_step(first.step(actions), second.step(actions), t)
    with pytest.raises(ValueError, match="holds 3 envs, this vector env 2"):
        gym.make_vec(ID, num_envs=2, vectorization_mode="vector_entry_point", **kwargs).load_state_dict(saved)


def test_bad_calls_are_refused():
    env = gym.make_vec(ID, num_envs=2, vectorization_mode="vector_entry_point", delay=2)
    with pytest.raises(RuntimeError, match=r"before reset\(\)"):
        env.step(np.zeros(2, dtype=np.int64))
    env.reset(seed=0)
    with pytest.raises(ValueError, match="are not in"):
        env.step(np.array([0, 2]))
    with pytest.raises(ValueError, match="are not in"):
        env.step(np.zeros(3, dtype=np.int64))
    with pytest.raises(ValueError, match="needs 2 seeds, got 1"):
        env.reset(seed=[1])
    with pytest.raises(ValueError, match="delay must be >= 0"):
        gym.make_vec(ID, num_envs=2, vectorization_mode="vector_entry_point", delay=-1)


def test_the_own_vector_env_refuses_wrappers_and_envs_without_one():
    with pytest.raises(SetupError, match=r"takes no env.wrappers or env.observation_keys; .*env.vectorization=sync"):
        make_vector_env(
            ID,
            2,
            vectorization="vector_entry_point",
            wrappers=[{"target": "gymnasium.wrappers:NormalizeObservation"}],
        )
    with pytest.raises(SetupError, match=r"'rl_replay/Chain-v0' registers no vector_entry_point"):
        make_vector_env("rl_replay/Chain-v0", 2, vectorization="vector_entry_point")


def memory_cfg(run_dir, vectorization: str, updates: int):
    return load_config(
        REPO / "configs" / "memory_256.yaml",
        [
            f"env.vectorization={vectorization}",
            "env.num_envs=4",
            "env.kwargs={delay: 6, noise_dims: 2}",
            "collector.num_steps=8",
            f"total_env_steps={updates * 32}",
            "agent.kwargs={hidden_size: 8, encoder_sizes: [8], readout_sizes: [8]}",
            "eval.every=3",  # and at the end: update 3 of the short run too
            "eval.episodes=4",
            "checkpoint.every=1",
            "log.progress=false",
            "log.wandb_mode=disabled",
            f"run_dir={run_dir}",
        ],
    )


def compared(rows):
    return [{k: v for k, v in row.items() if not k.startswith(("time/", "memory/", "system/"))} for row in rows]


def test_training_on_the_vector_env_equals_the_sync_run_and_resumes_exactly(tmp_path):
    build(memory_cfg(tmp_path / "sync", "sync", 6)).train()
    build(memory_cfg(tmp_path / "own", "vector_entry_point", 6)).train()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(environment state|no environment state|cannot be pickled)")
        build(memory_cfg(tmp_path / "part", "vector_entry_point", 3)).train()
        resumed = build(resume=tmp_path / "part", overrides=("total_env_steps=192",))
        resumed.train()
    sync, own, part = (read_metrics(tmp_path / name) for name in ("sync", "own", "part"))
    assert len(sync) == len(own) == len(part) == 6
    assert any(row["rollout/episodes"] for row in own) and "eval/success_rate" in own[2]
    # The same episodes, the same numbers: the vector env only steps them faster.
    assert compared(own) == compared(sync)
    assert compared(part) == compared(own)
    assert "vector_env" in load_checkpoint(tmp_path / "part")["collector"][0]
    assert not (tmp_path / "part" / "env_state.pkl").exists()  # nothing to unpickle
