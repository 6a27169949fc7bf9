"""The optional extras' environments ([minigrid], [atari], [memory-gym]): each config builds its env
and trains two updates through the real CLI when the package is installed (skipped otherwise),
and the extras install what those envs need without touching gymnasium's version."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "env.num_envs=2",
    "collector.num_steps=8",
    "total_env_steps=32",
    "ppo.num_minibatches=2",
    "eval.episodes=2",  # the configs evaluate at the end of training: 2 episodes, not their 32
    "log.wandb_mode=disabled",
    "log.progress=false",
    "checkpoint.every=0",
]


def train_two_updates_cli(tmp_path, config: str, *overrides: str) -> subprocess.CompletedProcess:
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "scripts/train.py", "--config", config, *TINY, *overrides, f"run_dir={run_dir}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["update"] for row in rows] == [1, 2] and (run_dir / "checkpoint.pt").exists()
    return out


def test_minigrid_memory_s7_trains_two_updates_and_evaluates(tmp_path):
    pytest.importorskip("minigrid")
    out = train_two_updates_cli(tmp_path, "configs/minigrid_memory_s7.yaml")
    assert "dropping the observation keys" not in out.stderr  # env.observation_keys chose them
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    ev = subprocess.run(
        [sys.executable, "scripts/evaluate.py", str(tmp_path / "run"), "--episodes", "3"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ev.returncode == 0, ev.stderr[-3000:]
    result = json.loads(ev.stdout.strip().splitlines()[-1])
    assert result["episodes"] == 3 and 0 <= result["success_rate"] <= 1  # SuccessOnReward's flag


def test_minigrid_raw_dict_drops_the_mission_with_one_warning_line(tmp_path):
    pytest.importorskip("minigrid")
    out = train_two_updates_cli(tmp_path, "configs/minigrid_memory_s7.yaml", "env.observation_keys=[]")
    warnings = [line for line in out.stderr.splitlines() if line.startswith("warning: dropping")]
    assert warnings == [
        "warning: dropping the observation keys ['mission'] (mission: MissionSpace), which hold no "
        "tensors; keeping ['direction', 'image']. Set env.observation_keys to choose the keys."
    ]


def test_minigrid_memory_s13_random_trains_two_updates(tmp_path):
    pytest.importorskip("minigrid")
    train_two_updates_cli(tmp_path, "configs/minigrid_memory_s13_random.yaml")


def test_atari_pong_lstm_trains_two_updates(tmp_path):
    pytest.importorskip("ale_py")
    pytest.importorskip("cv2")  # gymnasium's AtariPreprocessing resizes with OpenCV
    train_two_updates_cli(tmp_path, "configs/atari_pong_lstm.yaml")


@pytest.mark.parametrize(
    "config", ["configs/memorygym_mortar_mayhem_grid.yaml", "configs/memorygym_mystery_path_grid.yaml"]
)
def test_memory_gym_trains_two_updates(tmp_path, config):
    pytest.importorskip("memory_gym")
    train_two_updates_cli(tmp_path, config)


def _extras() -> dict[str, list[str]]:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_the_extras_name_what_the_envs_import():
    extras = _extras()
    assert any(r.startswith("minigrid") for r in extras["minigrid"])
    assert {r.split(">")[0] for r in extras["atari"]} == {"ale-py", "opencv-python-headless"}
    # memory-gym pins gymnasium==0.29.0: the extra holds its real dependencies, not the package,
    # so `pip install -e ".[memory-gym]"` cannot pull gymnasium below 1.0.
    assert not any(r.startswith("memory-gym") or r.startswith("gymnasium") for r in extras["memory-gym"])
    assert any(r.startswith("pygame") for r in extras["memory-gym"])
