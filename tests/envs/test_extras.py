"""The optional extras' environments ([minigrid], [atari], [memory-gym]): each config builds its env
and trains two updates through the real CLI when the package is installed (skipped otherwise),
and the extras install what those envs need without touching gymnasium's version."""

from __future__ import annotations

import json
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


def train_two_updates_cli(tmp_path, capsys, config: str, *overrides: str) -> str:
    """Two updates through the CLI's main in this process (its stderr returned)."""
    from rl_replay.run.cli import train_main

    run_dir = tmp_path / "run"
    code = train_main(["--config", config, *TINY, *overrides, f"run_dir={run_dir}"])
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["update"] for row in rows] == [1, 2] and (run_dir / "checkpoint.pt").exists()
    return err


def test_minigrid_memory_s7_trains_two_updates_and_evaluates(tmp_path, capsys):
    pytest.importorskip("minigrid")
    from rl_replay.run.cli import evaluate_main

    err = train_two_updates_cli(tmp_path, capsys, "configs/minigrid_memory_s7.yaml")
    assert "dropping the observation keys" not in err  # env.observation_keys chose them
    assert evaluate_main([str(tmp_path / "run"), "--episodes", "3"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["episodes"] == 3 and 0 <= result["success_rate"] <= 1  # SuccessOnReward's flag


def test_minigrid_raw_dict_drops_the_mission_with_one_warning_line(tmp_path, capsys):
    pytest.importorskip("minigrid")
    err = train_two_updates_cli(tmp_path, capsys, "configs/minigrid_memory_s7.yaml", "env.observation_keys=[]")
    warnings = [line for line in err.splitlines() if line.startswith("warning: dropping")]
    assert warnings == [
        "warning: dropping the observation keys ['mission'] (mission: MissionSpace), which hold no "
        "tensors; keeping ['direction', 'image']. Set env.observation_keys to choose the keys."
    ]


def test_minigrid_memory_s13_random_trains_two_updates(tmp_path, capsys):
    pytest.importorskip("minigrid")
    train_two_updates_cli(tmp_path, capsys, "configs/minigrid_memory_s13_random.yaml")


def test_atari_pong_lstm_trains_two_updates(tmp_path, capsys):
    pytest.importorskip("ale_py")
    pytest.importorskip("cv2")  # gymnasium's AtariPreprocessing resizes with OpenCV
    train_two_updates_cli(tmp_path, capsys, "configs/atari_pong_lstm.yaml")


@pytest.mark.parametrize(
    "config", ["configs/memorygym_mortar_mayhem_grid.yaml", "configs/memorygym_mystery_path_grid.yaml"]
)
def test_memory_gym_trains_two_updates(tmp_path, capsys, config):
    pytest.importorskip("memory_gym")
    train_two_updates_cli(tmp_path, capsys, config)


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
