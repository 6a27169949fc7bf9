"""env.vectorization=envpool (rl_replay/rollout/envpool_env.py): EnvPool's real envs behind the vector-env
semantics the collector relies on, and its refusals. The EnvPool tests skip where it is not installed
(pip install -e ".[envpool]"); the refusals run everywhere."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from _runs import TINY

from rl_replay.errors import SetupError
from rl_replay.rollout.environment import RAW_EPISODE_KEY, make_vector_env
from rl_replay.rollout.episodes import EpisodeTracker
from rl_replay.run.cli import train_main


def needs_envpool():
    pytest.importorskip("envpool", reason="needs the envpool extra: pip install -e '.[envpool]'")


def play(envs, steps: int, seed: int = 3):
    """Random actions through the collector's episode bookkeeping: every step's (reward, terminated,
    truncated, info, is_first) and the episodes it reports."""
    tracker = EpisodeTracker(envs.num_envs)
    envs.reset(seed=seed)
    envs.action_space.seed(seed)
    rows, episodes = [], []
    for _ in range(steps):
        valid = tracker.real_steps()
        obs, reward, terminated, truncated, info = envs.step(envs.action_space.sample())
        ended, is_first = tracker.step(reward, terminated, truncated, info, valid)
        rows.append((obs, reward, terminated, truncated, info, valid))
        episodes += ended
    return rows, episodes


def test_cartpole_keeps_next_step_autoreset_and_reports_each_episode_once():
    needs_envpool()
    envs = make_vector_env("CartPole-v1", 4, vectorization="envpool")
    try:
        assert envs.single_observation_space.shape == (4,) and envs.single_action_space.n == 2
        rows, episodes = play(envs, 200)
    finally:
        envs.close()
    assert len(episodes) >= 20
    for (_, reward, terminated, truncated, _info, valid), (_, _, prev_term, prev_trunc, _, _) in zip(rows[1:], rows):
        after = prev_term | prev_trunc
        # the step after an episode's end is the autoreset step: reward 0, no end, not a step of any episode
        assert np.all(reward[after] == 0) and not np.any((terminated | truncated)[after]) and not np.any(valid[after])
    for e in episodes:  # CartPole pays 1 per step: the raw return is the length
        assert e.ret == e.length > 0
    reported = sum(int(row[4].get("_" + RAW_EPISODE_KEY, np.zeros(4, bool)).sum()) for row in rows)
    assert reported == len(episodes)


def test_a_time_limit_is_a_truncation_not_a_termination():
    needs_envpool()
    envs = make_vector_env("CartPole-v1", 4, vectorization="envpool", max_episode_steps=8)
    try:
        rows, episodes = play(envs, 120)
    finally:
        envs.close()
    truncated = [e for e in episodes if e.length == 8]
    assert truncated and all(e.length <= 8 for e in episodes)
    assert any(row[3].any() and not row[2][row[3]].any() for row in rows)  # truncated, not terminated


def test_atari_returns_count_the_games_score_under_envpools_reward_clip():
    """SpaceInvaders pays 5-30 points per alien; EnvPool clips each reward to 1 (reward_clip), and the
    episode's return is still the score, as gymnasium's RecordEpisodeStatistics beneath ClipReward gives."""
    needs_envpool()
    kwargs = {"stack_num": 1, "reward_clip": True, "episodic_life": False, "repeat_action_probability": 0.0}
    envs = make_vector_env("ALE/SpaceInvaders-v5", 2, vectorization="envpool", kwargs=kwargs, max_episode_steps=300)
    try:
        assert envs.single_observation_space.shape == (84, 84)  # a stack of one, as AtariPreprocessing's frame
        rows, episodes = play(envs, 320)
    finally:
        envs.close()
    assert all(set(np.unique(row[1])) <= {0.0, 1.0} for row in rows)  # the agent is paid clipped rewards
    scored = [e for e in episodes if e.ret > 0]
    assert scored, episodes
    clipped = {}
    for env in range(2):
        clipped[env] = sum(
            row[1][env] for row in rows[: next(i for i, r in enumerate(rows) if r[3][env] or r[2][env]) + 1]
        )
    first = {e.env: e for e in reversed(episodes)}
    assert any(first[i].ret > clipped[i] for i in first)  # the score, not the number of rewarded steps


def test_a_run_trains_and_its_resume_says_it_starts_fresh_episodes(tmp_path, capsys):
    needs_envpool()
    run = tmp_path / "run"
    assert train_main([*TINY, "env.vectorization=envpool", "total_env_steps=32", f"run_dir={run}"]) == 0
    with pytest.warns(UserWarning, match=r"env\.vectorization=envpool: EnvPool's envs live in its threads"):
        assert train_main(["--resume", str(run), "total_env_steps=48"]) == 0
    rows = (run / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 3


def test_refusals_are_one_line(monkeypatch):
    with pytest.raises(SetupError, match=r"envpool steps EnvPool's envs, which take no env\.wrappers"):
        make_vector_env(
            "CartPole-v1", 2, vectorization="envpool", wrappers=[{"target": "gymnasium.wrappers:ClipReward"}]
        )
    monkeypatch.setitem(sys.modules, "envpool", None)  # as where it is not installed
    with pytest.raises(SetupError, match=r"needs EnvPool, which is not installed: pip install -e '\.\[envpool\]'"):
        make_vector_env("CartPole-v1", 2, vectorization="envpool")


def test_an_id_envpool_does_not_have_names_the_other_vectorizations():
    needs_envpool()
    with pytest.raises(
        SetupError, match=r"EnvPool has no environment 'MountainCarContinuous-v9'.*sync, async or vector_entry_point"
    ):
        make_vector_env("MountainCarContinuous-v9", 2, vectorization="envpool")
