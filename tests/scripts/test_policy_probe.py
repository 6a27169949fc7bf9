"""scripts/tools/policy_probe.py on a real run of a shipped POPGym config, and its refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rl_replay.config import load_config, save_config

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
    save_config(load_config(ROOT / "configs" / "ppo_cartpole.yaml"), run / "config.yaml")
    (run / "checkpoint.pt").write_bytes(b"not a checkpoint")
    out = subprocess.run([sys.executable, str(SCRIPT), str(run)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "not a Dict with 'obs' and 'prev_action'" in out.stderr and "PreviousAction" in out.stderr


def test_not_a_run_directory_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "is not a run directory with a checkpoint" in out.stderr
