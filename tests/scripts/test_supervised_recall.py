"""scripts/tools/supervised_recall.py: the supervised recall probe learns what it should and not what it cannot."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "tools" / "supervised_recall.py"


def accuracy(*args: str) -> float:
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return float(re.findall(r"accuracy ([\d.]+)", proc.stdout)[-1])


def _probe():
    """scripts/tools/supervised_recall.py as a module."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import supervised_recall
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return supervised_recall


def _suits_seen(env, seed: int) -> torch.Tensor:
    """The (T, 1) suits a card env shows before each action of its episode for ``seed`` (they do not
    depend on the actions)."""
    obs, _ = env.reset(seed=seed)
    suits, done = [obs["obs"]], False
    while not done:
        obs, _, terminated, truncated, _ = env.step(0)
        suits.append(obs["obs"])
        done = terminated or truncated
    return torch.as_tensor(suits[:-1]).reshape(-1, 1)


def test_a_window_that_reaches_the_cue_learns_it_and_one_that_does_not_stays_at_chance():
    agent = "{d_model: 16, num_layers: 1, num_heads: 2, encoder_sizes: [16], window: %d}"
    assert accuracy("--delay", "6", "--steps", "101", "gtrxl", agent % 8) == 1.0
    # the cue is 7 steps before the query; a window of 6 (one layer) cannot see it
    assert accuracy("--delay", "6", "--steps", "101", "--batch", "256", "gtrxl", agent % 6) < 0.65


def test_repeat_previous_probe_learns_the_suit_within_reach_and_not_beyond():
    # RepeatPrevious with k = 3 asks for the suit seen 2 steps back: a window of 4 holds it, a window of
    # 1 (the last step and the step itself) does not
    agent = "{d_model: 16, num_layers: 1, num_heads: 2, encoder_sizes: [16], window: %d}"
    task = ("--task", "repeat_previous", "--k", "3", "--decks", "1", "--steps", "151", "--lr", "3e-3")
    assert accuracy(*task, "gtrxl", agent % 4) > 0.9
    assert accuracy(*task, "gtrxl", agent % 1) < 0.35


def test_repeat_previous_labels_follow_the_real_envs_reward_rule():
    # the probe's labels for the suits popgym's own RepeatPrevious shows (behind the table's wrapper),
    # played back in that env, earn every reward it gives
    pytest.importorskip("popgym")
    from popgym.envs.repeat_previous import RepeatPrevious

    from envs.wrappers import PreviousAction

    supervised_recall = _probe()
    k, episodes = 5, 3
    _, labelled, _ = supervised_recall.repeat_previous_batch(k, 1, 1, np.random.default_rng(0))
    for seed in range(episodes):
        # the env's episode for this seed, played once to read its suits (its cards do not depend on actions)
        env = PreviousAction(RepeatPrevious(num_decks=1, k=k))
        suits_t = _suits_seen(env, seed)
        assert suits_t.shape == labelled.shape  # the probe's episode length is the env's
        mask, labels = supervised_recall.repeat_previous_labels(suits_t, k)
        assert torch.equal(mask, labelled)
        obs, _ = env.reset(seed=seed)
        rewards = []
        for t in range(suits_t.shape[0]):
            obs, reward, terminated, truncated, _ = env.step(int(labels[t, 0]))
            rewards.append(reward)
        assert terminated
        assert all(r == 0 for r in rewards[: k - 1]) and all(r > 0 for r in rewards[k - 1 :]), rewards


def test_repeat_first_labels_follow_the_real_envs_reward_rule():
    pytest.importorskip("popgym")
    from popgym.envs.repeat_first import RepeatFirst

    from envs.wrappers import PreviousAction

    supervised_recall = _probe()
    env = PreviousAction(RepeatFirst(num_decks=1))
    suits_t = _suits_seen(env, 5)
    mask, labels = supervised_recall.repeat_previous_labels(suits_t, 0)
    assert mask.all() and (labels == suits_t[0]).all()
    env.reset(seed=5)
    rewards = [env.step(int(labels[t, 0]))[1] for t in range(suits_t.shape[0])]
    assert all(r > 0 for r in rewards), rewards
    assert any(int(s) != int(suits_t[0, 0]) for s in suits_t[:, 0])  # the rule is not "repeat the current card"
