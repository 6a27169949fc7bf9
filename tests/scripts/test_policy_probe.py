"""scripts/tools/policy_probe.py on a real run of a shipped POPGym config, and its refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rl_replay.config import dump_config, load_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "tools" / "policy_probe.py"


def test_the_probe_reads_a_trained_popgym_run(tmp_path):
    pytest.importorskip("popgym")
    from _runs import tiny_popgym_run

    run = tmp_path / "run"
    tiny_popgym_run(run, updates=1)
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(run), "--episodes", "3", "--lags", "31", "32"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("309 steps of 3 episodes")  # three whole 103-step episodes
    histogram = [float(x) for x in out.stdout.splitlines()[1].split(":")[1].split()]
    assert len(histogram) == 4 and sum(histogram) == pytest.approx(1.0, abs=2e-3)
    for lag in (0, 31, 32):
        line = next(x for x in out.stdout.splitlines() if x.startswith(f"action == card {lag} steps back"))
        assert 0.0 <= float(line.split(": ")[1].split()[0]) <= 1.0
    # one update from a random start: the policy is near uniform whatever the previous action
    change = float(out.stdout.rsplit("largest action-probability change ", 1)[1])
    assert 0.0 <= change < 0.5


def test_a_run_without_the_previous_action_is_refused_before_its_checkpoint_is_read(tmp_path):
    run = tmp_path / "cartpole"
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(load_config(ROOT / "configs" / "ppo_cartpole.yaml")))
    (run / "checkpoint.pt").write_bytes(b"not a checkpoint")
    out = subprocess.run([sys.executable, str(SCRIPT), str(run)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "not a Dict with 'obs' and 'prev_action'" in out.stderr and "PreviousAction" in out.stderr


def test_not_a_run_directory_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "is not a run directory with a checkpoint" in out.stderr


class _FirstCardPolicy:
    """A scripted policy for the probe's arithmetic: it answers the card its episode opened with,
    whatever the previous action, and values every state at 0."""

    def __init__(self, n: int):
        self.n = n

    def initial_state(self, num, device):
        import torch

        return torch.zeros(num, dtype=torch.long)

    def __call__(self, observation, state, is_first):
        import torch

        card = observation["obs"].argmax(-1).reshape(-1)  # the converter one-hots a Discrete card
        state = torch.where(is_first, card, state)
        logits = torch.full((len(state), self.n), -30.0).scatter(1, state[:, None], 30.0)
        return {"logits": logits, "value": torch.zeros(len(state)), "state": state}

    def distribution(self, out):
        import torch

        return torch.distributions.Categorical(logits=out["logits"])


def test_the_probe_measures_what_a_scripted_policy_does():
    """On popgym's RepeatFirstEasy, a policy that answers the first card agrees with it on every step,
    repeats its previous answer and ignores the previous-action input; the card one step back
    agrees only by chance."""
    pytest.importorskip("popgym")
    import gymnasium as gym
    import popgym  # noqa: F401  (registers the ids)

    from rl_replay.envs.wrappers import PreviousAction
    from rl_replay.spaces import obs_converter

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from policy_probe import _play
    finally:
        sys.path.remove(str(SCRIPT.parent))
    envs = gym.vector.SyncVectorEnv([lambda: PreviousAction(gym.make("popgym-RepeatFirstEasy-v0"))] * 4)
    try:
        r = _play(_FirstCardPolicy(4), envs, obs_converter(envs.single_observation_space), 4, [1], 0, 60)
    finally:
        envs.close()
    assert r["agrees_with_first_card"] == 1.0
    assert r["repeats_previous_action"] == 1.0
    assert r["largest_probability_change_over_previous_action"] == pytest.approx(0.0, abs=1e-6)
    assert r["value_spread_over_previous_action"] == 0.0
    assert r["agrees_with_card"][1] < 0.6  # the card one step back: chance (0.25) over ~200 steps
