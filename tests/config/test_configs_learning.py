"""The shipped learning configs (configs/memory_*.yaml, configs/ppo_memory_*.yaml, configs/tmaze_*.yaml,
configs/popgym/*.yaml) build their
env and agent and train: tiny sizes, a couple of updates each. The learning itself is
measured in docs/learning.md, not here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rl_replay.config import load_config
from rl_replay.run.setup import build

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MEMORY = sorted([*CONFIGS.glob("memory_*.yaml"), *CONFIGS.glob("ppo_memory_*.yaml")])
POPGYM_TABLE = sorted(p for p in (CONFIGS / "popgym").glob("*.yaml") if p.name != "base.yaml")
TMAZE = sorted(CONFIGS.glob("tmaze_*.yaml"))
TINY = ["log.wandb_mode=disabled", "log.progress=false", "checkpoint.every=0"]


def tiny_agent(target: str, recurrence: str | None = None) -> str:
    if target == "lru":
        return "agent.kwargs={hidden_size: 8, encoder_sizes: [8], readout_sizes: [8]}"
    if target == "gtrxl":
        return f"agent.kwargs={{d_model: 8, num_heads: 2, window: 4, recurrence: {recurrence or 'null'}, recurrent_size: 8}}"
    return "agent.kwargs={hidden_size: 8, encoder_sizes: [8]}"


def tiny(path: Path, tmp_path: Path, shipped, *overrides: str):
    """``path``'s config with a tiny agent, no logging or checkpoints, and ``overrides``."""
    return load_config(
        path,
        [
            *TINY,
            *overrides,
            f"run_dir={tmp_path / 'run'}",
            tiny_agent(shipped.agent.target, shipped.agent.kwargs.get("recurrence")),
        ],
    )


def train(cfg, updates: int):
    trainer = build(cfg)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.train()
    assert trainer.update == updates
    assert np.isfinite(metrics["train/loss_policy"]) and np.isfinite(metrics["train/loss_value"])
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    return trainer, metrics


def test_the_config_globs_find_the_shipped_configs():
    names = {p.name for p in MEMORY + POPGYM_TABLE + TMAZE}
    assert {
        "memory_256.yaml",
        "memory_gru.yaml",
        "ppo_memory_256.yaml",
        "ppo_memory_gru.yaml",
        "repeat_previous_medium.yaml",
        "count_recall_easy.yaml",
        "tmaze_passive_100.yaml",
        "tmaze_passive_1500.yaml",
        "tmaze_passive_4096.yaml",
    } <= names


@pytest.mark.parametrize("path", TMAZE, ids=lambda p: p.stem)
def test_tmaze_config_keeps_length_and_reward_scale_in_sync_and_runs_an_update(path, tmp_path):
    shipped = load_config(path)
    length = shipped.env.kwargs["corridor_length"]
    assert shipped.collector.mode == "episode" and shipped.collector.num_steps == length + 1
    (wrapper,) = shipped.env.wrappers  # the previous reward, scaled so that a penalty of -1/L reads -1
    assert wrapper["target"].endswith(":PreviousActionReward") and wrapper["kwargs"]["reward_scale"] == length
    # init_from=null: a curriculum stage's source run is not here; its weights would not fit the tiny agent.
    cfg = tiny(
        path,
        tmp_path,
        shipped,
        "init_from=null",
        "env.num_envs=2",
        "env.kwargs.corridor_length=5",
        "collector.num_steps=6",
        "total_env_steps=12",
    )
    _, metrics = train(cfg, updates=1)
    assert metrics["rollout/episodes"] == 2 and 0 <= metrics["rollout/success_rate"] <= 1


@pytest.mark.parametrize("path", MEMORY, ids=lambda p: p.stem)
def test_memory_config_keeps_step_cap_in_sync_and_runs_an_update(path, tmp_path):
    shipped = load_config(path)
    # Whole episodes: the step cap must cover the cue, the delay and the query.
    assert shipped.collector.mode == "episode"
    assert shipped.collector.num_steps == shipped.env.kwargs["delay"] + 2
    cfg = tiny(
        path, tmp_path, shipped, "env.num_envs=2", "env.kwargs.delay=6", "collector.num_steps=8", "total_env_steps=16"
    )
    _, metrics = train(cfg, updates=1)
    assert metrics["rollout/episodes"] == 2 and 0 <= metrics["rollout/success_rate"] <= 1


@pytest.mark.parametrize("path", POPGYM_TABLE, ids=lambda p: p.stem)
def test_popgym_table_config_sees_the_previous_action_and_runs_an_update(path, tmp_path):
    pytest.importorskip("popgym")
    shipped = load_config(path)
    cfg = tiny(
        path,
        tmp_path,
        shipped,
        "env.num_envs=4",
        "collector.num_steps=8",
        "total_env_steps=32",
        "ppo.num_minibatches=2",
    )
    trainer, _ = train(cfg, updates=1)
    space = trainer.collector.envs.single_observation_space
    assert set(space.spaces) == {"obs", "prev_action", "is_first"}
    assert space["prev_action"] == trainer.collector.envs.single_action_space
