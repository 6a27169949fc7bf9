"""Command-line scripts: one-line errors with exit code 2 and no output on disk; evaluate."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest
from _runs import start

from rl_replay.agent import build_agent
from rl_replay.config import load_config
from rl_replay.rollout.environment import make_vector_env
from rl_replay.run.evaluate import evaluate
from rl_replay.run.setup import build
from rl_replay.rundir.checkpoint import load_checkpoint

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "scripts" / "train.py")
EVALUATE = str(REPO / "scripts" / "evaluate.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}


def load_script(path):
    spec = importlib.util.spec_from_file_location(f"_script_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_errors_are_one_line_exit_2_and_write_nothing(tmp_path):
    # A real interpreter per case (started in parallel): nothing else may reach stderr.
    cases = {
        "bad-env": (["env.id=NoSuchEnv-v3"], r"error: unknown environment id 'NoSuchEnv-v3'"),
        "missing-config": (["--config", tmp_path / "nope.yaml"], r"error: Config file not found: .*nope\.yaml"),
        "bad-override": (["optim.bogus=1"], r"error: Unknown config key 'optim\.bogus'"),
    }
    procs = {}
    for name, (args, _) in cases.items():
        cwd = tmp_path / name
        cwd.mkdir()
        procs[name] = start(TRAIN, *args, f"run_dir={cwd / 'run'}", "log.progress=false", cwd=cwd)
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        lines = err.strip().splitlines()
        assert proc.returncode == 2, (name, proc.returncode, err)
        assert len(lines) == 1, (name, err)
        assert re.match(cases[name][1], lines[0]), (name, lines[0])
        assert out == ""
        assert list((tmp_path / name).iterdir()) == [], name  # no run dir, no runs/, no wandb/


@pytest.mark.parametrize(
    "args, pattern",
    [
        (["env.num_envs=many"], r"error: Invalid type for config key 'env\.num_envs'"),
        (["no_equals_sign"], r"error: Malformed override 'no_equals_sign'"),
        (["agent.target=rl_replay.agents.mlp:Nope"], r"error: agent\.target 'rl_replay\.agents\.mlp:Nope': module"),
        (["collector.num_steps=0"], r"error: Out of range value for config key 'collector\.num_steps'"),
        (
            ["--resume", "{tmp}/missing_run"],
            r"error: cannot resume .*missing_run: no such directory\. Start a new "
            r"run there with run_dir=.*missing_run$",
        ),
    ],
    ids=["bad-type", "malformed", "agent", "range", "resume"],
)
def test_train_main_errors_in_process(tmp_path, monkeypatch, capsys, args, pattern):
    monkeypatch.chdir(tmp_path)
    train = load_script(TRAIN)
    args = [a.format(tmp=tmp_path) for a in args]
    if "--resume" not in args:  # a resume names its run directory itself
        args.append(f"run_dir={tmp_path / 'run'}")
    assert train.main(args) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and re.match(pattern, lines[0]), err
    assert list(tmp_path.iterdir()) == []


def test_a_mistyped_config_path_names_the_nearest_config_and_lists_them(tmp_path, monkeypatch, capsys):
    train = load_script(TRAIN)
    shipped = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))
    monkeypatch.chdir(REPO)
    assert train.main(["--config", "configs/memry_gru.yaml"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        "error: Config file not found: configs/memry_gru.yaml (did you mean configs/memory_gru.yaml?). "
        f"Configs in configs/: {', '.join(shipped)}"
    )
    (tmp_path / "mine.yaml").write_text("seed: 2\n")
    monkeypatch.chdir(tmp_path)
    assert train.main(["--config", "mien.yaml"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        "error: Config file not found: mien.yaml (did you mean mine.yaml?). Configs in ./: "
        f"mine.yaml; {REPO / 'configs'}/: {', '.join(shipped)}"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.yaml"]


def test_the_masked_cartpole_config_starts_without_box_precision_warnings(tmp_path):
    """RescaleObservation's float bounds made gymnasium warn twice at every start."""
    proc = start(
        TRAIN,
        "--config",
        REPO / "configs" / "ppo_pocartpole_gru.yaml",
        "total_env_steps=1",
        "log.progress=false",
        f"run_dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    assert "precision lowered" not in err, err


def test_evaluate_prints_mean_and_std(tmp_path):
    run_dir = tmp_path / "run"
    cfg = load_config(
        None,
        [
            "env.num_envs=2",
            "env.max_episode_steps=30",
            "collector.num_steps=8",
            "total_env_steps=48",
            "agent.kwargs={hidden_sizes: [16]}",
            "log.progress=false",
            "log.wandb_mode=disabled",
            f"run_dir={run_dir}",
        ],
    )
    build(cfg).train()
    proc = start(EVALUATE, run_dir, "--episodes", 3, cwd=tmp_path)
    side_by_side = start(EVALUATE, run_dir, "--episodes", 3, "--num-envs", 3, cwd=tmp_path)

    # What the script should print: the checkpoint's agent, evaluated here.
    state = load_checkpoint(run_dir)
    probe = make_vector_env("CartPole-v1", 1)
    agent = build_agent(cfg.agent.target, cfg.agent.kwargs, probe.single_observation_space, probe.single_action_space)
    probe.close()
    agent.load_state_dict(state["agent"])
    expected = evaluate(agent, "CartPole-v1", episodes=3, seed=12345, max_episode_steps=30)
    assert expected["episodes"] == 3 and 1 <= expected["return_mean"] <= 30

    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    first, result = out.strip().splitlines()[-2:]
    assert first == (
        f"return {expected['return_mean']:.2f} +- {expected['return_std']:.2f} over 3 "
        f"episodes (checkpoint update 3, 48 env steps)"
    )
    assert json.loads(result) == expected
    # --num-envs 3: the three episodes side by side, as evaluate(num_envs=3) plays them.
    out, err = side_by_side.communicate(timeout=120)
    assert side_by_side.returncode == 0, err
    wide = evaluate(agent, "CartPole-v1", episodes=3, num_envs=3, seed=12345, max_episode_steps=30)
    assert json.loads(out.strip().splitlines()[-1]) == wide


def test_evaluate_error_in_process(tmp_path, capsys):
    evaluate_script = load_script(EVALUATE)
    assert evaluate_script.main([str(tmp_path / "no_run"), "--episodes", "3"]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("error: no run directory"), err


def test_evaluate_records_video(tmp_path):
    """The optional video path (skipped unless the `video` extra is installed)."""
    pytest.importorskip("moviepy")
    pytest.importorskip("pygame")
    import gymnasium as gym

    from rl_replay.agents.mlp import MLPAgent
    from rl_replay.run.evaluate import evaluate

    env = gym.make("CartPole-v1")
    agent = MLPAgent(env.observation_space, env.action_space, hidden_sizes=(8,))
    result = evaluate(agent, "CartPole-v1", episodes=2, video_dir=str(tmp_path / "videos"), max_episode_steps=50)
    assert result["episodes"] == 2
    videos = sorted(p.name for p in (tmp_path / "videos").glob("*.mp4"))
    assert len(videos) >= 2, videos


# ----------------------------------------------------------------------------- plot_metrics
PLOT = str(REPO / "scripts" / "tools" / "plot_metrics.py")


def test_plot_metrics_prints_the_same_table_from_metrics_jsonl_and_the_offline_wandb_run(tmp_path, monkeypatch, capsys):
    """A user reads an offline run locally, no matplotlib needed: the table of metrics.jsonl and
    the one of the wandb files (what `wandb sync` would upload) agree row for row."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_MODE", "WANDB_DISABLED", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    run_dir = tmp_path / "run"
    build(
        load_config(
            None,
            [
                "env.num_envs=2",
                "collector.num_steps=8",
                "total_env_steps=96",
                "agent.kwargs={hidden_sizes: [16]}",
                "log.progress=false",
                "log.wandb_mode=offline",
                "checkpoint.every=2",
                f"run_dir={run_dir}",
            ],
        )
    ).train()
    plot = load_script(PLOT)
    outputs = {}
    for source in ("metrics", "wandb"):
        assert plot.main([str(run_dir), "--source", source, "--every", "1"]) == 0
        outputs[source] = capsys.readouterr().out.splitlines()
    head, *rest = outputs["metrics"]
    assert head == f"{run_dir}: 6 rows from metrics.jsonl"
    assert outputs["wandb"] == [f"{run_dir}: 6 rows from the offline wandb run", *rest]
    columns = rest[0].split()
    assert columns[:2] == ["update", "env_steps"] and "rollout/return_recent" in columns
    assert [line.split()[:2] for line in rest[1:7]] == [[str(u), str(16 * u)] for u in range(1, 7)]
    assert "summary/env_steps: 96" in rest


def test_plot_metrics_errors_are_one_line(tmp_path, monkeypatch, capsys):
    plot = load_script(PLOT)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"update": 1, "env_steps": 8, "rollout/return_mean": null}\n')
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: import fails
    cases = [
        ([str(run_dir), str(tmp_path / "out.png")], 'error: plotting needs matplotlib: pip install -e ".[bench]"'),
        ([str(tmp_path / "none")], f"error: no rows in {tmp_path / 'none' / 'metrics.jsonl'}"),
        ([str(run_dir), "--source", "wandb"], f"error: no rows in {run_dir / 'wandb' / 'offline-run-*'}"),
        ([str(run_dir), "--keys", "nope"], "error: no row of metrics.jsonl has nope; its keys: env_steps, "),
    ]
    for args, start_of_line in cases:
        assert plot.main(args) == 2, args
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith(start_of_line), (args, err)
    assert not (tmp_path / "out.png").exists()
