"""The README's custom-agent example must keep working exactly as printed."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from rl_replay.config import load_config
from rl_replay.trainer import build

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_custom_agent_trains(tmp_path, monkeypatch):
    text = README.read_text()
    source = text.split("# my_pkg/policies.py\n", 1)[1].split("```", 1)[0]
    package = tmp_path / "my_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "policies.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))

    cfg = load_config(overrides=[
        "agent.target=my_pkg.policies:MyAgent", "agent.kwargs={hidden: 16}", "total_env_steps=400",
        "log.wandb_mode=disabled", "log.progress=false", f"run_dir={tmp_path / 'run'}",
    ])
    trainer = build(cfg)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.update == 10
    assert all(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters()))


def test_readme_wrappers_example_trains(tmp_path):
    text = README.read_text()
    block = text.split("# wrappers example\n", 1)[1].split("```", 1)[0]
    config = tmp_path / "wrapped.yaml"
    config.write_text(block)
    cfg = load_config(config, ["env.num_envs=2", "collector.num_steps=4", "total_env_steps=8",
                               "log.wandb_mode=disabled", "log.progress=false", f"run_dir={tmp_path / 'run'}"])
    assert [w["target"] for w in cfg.env.wrappers] == ["gymnasium.wrappers:NormalizeObservation",
                                                       "gymnasium.wrappers.NormalizeReward"]
    trainer = build(cfg)
    env = trainer.collector.envs.envs[0]
    assert type(env).__name__ == "NormalizeReward" and type(env.env).__name__ == "NormalizeObservation"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the wrapped envs pickle into the checkpoint
        trainer.train()
    assert trainer.update == 1
