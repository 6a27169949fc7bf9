"""The command line: refusals, intermixed overrides, --help listing every config key, console entry points."""

from __future__ import annotations

import re
from pathlib import Path

from _runs import (
    REPO,
    TINY,
    TRAIN,
    finish,
    one_error_line,
    start,
)

from rl_replay.config import Config, load_config


def test_cli_refusals_and_intermixed_overrides(tmp_path, monkeypatch, capsys):
    from rl_replay.run.cli import train_main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("collector: {num_steps: 4}\n")
    cases = {
        "lr-inf": (["optim.lr=.inf"], r"error: Non-finite value for config key 'optim\.lr': inf"),
        "contract": (
            ["agent.target=safety_agents:ColumnValueAgent", "agent.kwargs={}"],
            r"error: agent safety_agents:ColumnValueAgent: forward\(\) returned 'value' of shape",
        ),
    }
    procs = {}
    for name, (args, _) in cases.items():
        (tmp_path / name).mkdir()
        procs[name] = start(TRAIN, *TINY, *args, f"run_dir={tmp_path / name / 'run'}", cwd=tmp_path / name)
    mixed = tmp_path / "mixed"
    procs["mixed"] = start(
        TRAIN,
        "env.num_envs=2",
        "log.progress=false",
        "--config",
        cfg,
        "total_env_steps=16",
        "log.wandb_mode=disabled",
        f"run_dir={mixed}",
        cwd=tmp_path,
    )
    for name, (_args, pattern) in cases.items():
        code, out, err = finish(procs[name])
        assert code == 2 and re.match(pattern, one_error_line(err)), (name, err)
        assert list((tmp_path / name).iterdir()) == [], name
    code, out, err = finish(procs["mixed"])
    assert code == 0, err
    monkeypatch.chdir(tmp_path / "lr-inf")
    for args, pattern in (
        (["seed=-1"], r"error: Out of range value for config key 'seed': -1"),
        (["optim.lr=.nan"], r"error: Non-finite value for config key 'optim\.lr': nan"),
    ):
        assert train_main([*TINY, *args]) == 2
        assert re.match(pattern, one_error_line(capsys.readouterr().err)), args
    assert list(Path.cwd().iterdir()) == []
    saved = load_config(mixed / "config.yaml")
    assert (saved.env.num_envs, saved.collector.num_steps, saved.total_env_steps) == (2, 4, 16)


def test_help_lists_every_config_key_with_its_docstring(tmp_path):
    from rl_replay.config.loader import _iter_leaves
    from rl_replay.run.cli import _field_docs

    code, out, err = finish(start(TRAIN, "--help", cwd=tmp_path))
    assert code == 0, err
    lines = out.splitlines()
    for key, _, _ in _iter_leaves(Config()):
        section, _, name = key.rpartition(".")
        cls = type(getattr(Config(), section)) if section else Config
        doc = _field_docs(cls)[name]
        assert doc, key
        row = [x for x in lines if x.split()[:1] == [key]]
        assert len(row) == 1 and row[0].endswith(doc), (key, row)
    for section in ("env", "agent", "collector", "loss", "optim", "log", "checkpoint", "eval", "distributed"):
        assert any(x.startswith(f"{section}: ") for x in lines), section


def test_console_entry_points_resolve(capsys):
    import importlib

    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == {"rl-replay-train", "rl-replay-evaluate"}
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), name
    from rl_replay.run.cli import evaluate_main

    assert evaluate_main(["/nonexistent"]) == 2
    assert one_error_line(capsys.readouterr().err).startswith("error: no run directory /nonexistent")


def test_resume_auto_starts_a_run_then_continues_it_with_no_row_twice(tmp_path, capsys):
    """``--resume auto run_dir=R``, what a job that restarts itself runs every time: the first call
    starts the run in R, later ones continue it from its checkpoint; metrics rows strictly increase."""
    import json

    from rl_replay.run.cli import train_main

    run_dir = tmp_path / "run"
    for total, said in ((2 * 16, "holds no run: starting it there"), (4 * 16, "resuming the run there")):
        assert train_main(["--resume", "auto", *TINY, f"total_env_steps={total}", f"run_dir={run_dir}"]) == 0
        assert f"--resume auto: {run_dir} {said}" in capsys.readouterr().err
    updates = [json.loads(line)["update"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert updates == [1, 2, 3, 4]
    assert train_main(["--resume", "auto", *TINY, "total_env_steps=32"]) == 2  # no run_dir: nothing to decide on
    assert "--resume auto needs the run directory: pass run_dir=" in one_error_line(capsys.readouterr().err)
