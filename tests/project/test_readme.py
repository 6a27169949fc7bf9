"""The README's examples (engine, custom agent) and docs/configuration.md's wrappers example keep
working exactly as printed."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from rl_replay.config import load_config
from rl_replay.run.setup import build

README = Path(__file__).resolve().parents[2] / "README.md"
CONFIGURATION = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_readme_engine_example_runs_and_its_gradients_are_plain_autograds():
    source = README.read_text().split("# engine example\n", 1)[1].split("```", 1)[0]
    assert "optimizer.step()" in source
    namespace: dict = {}
    torch.manual_seed(0)
    exec(compile(source.replace("optimizer.step()", "pass"), "README engine example", "exec"), namespace)
    policy, obs, acc = namespace["policy"], namespace["obs"], namespace["acc"]
    assert acc.num_blocks == namespace["T"]
    replayed = [p.grad.clone() for p in policy.parameters()]
    # The same loss with plain autograd (clipping applied the same way).
    policy.zero_grad()
    T, B = namespace["T"], namespace["B"]
    h, loss = torch.zeros(B, 16), 0.0
    for t in range(T):
        h = policy.cell(obs[t], h)
        loss = loss + policy.value(h).squeeze(-1).square().mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 0.5)
    for got, want in zip(replayed, [p.grad for p in policy.parameters()]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_readme_custom_agent_trains(tmp_path, monkeypatch):
    text = README.read_text()
    source = text.split("# my_pkg/policies.py\n", 1)[1].split("```", 1)[0]
    package = tmp_path / "my_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "policies.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))

    cfg = load_config(
        overrides=[
            "agent.target=my_pkg.policies:MyAgent",
            "agent.kwargs={hidden: 16}",
            "total_env_steps=400",
            "log.wandb_mode=disabled",
            "log.progress=false",
            f"run_dir={tmp_path / 'run'}",
        ]
    )
    trainer = build(cfg)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.update == 10
    assert all(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters()))


def test_readme_wrappers_example_trains(tmp_path):
    text = CONFIGURATION.read_text()
    block = text.split("# wrappers example\n", 1)[1].split("```", 1)[0]
    config = tmp_path / "wrapped.yaml"
    config.write_text(block)
    cfg = load_config(
        config,
        [
            "env.num_envs=2",
            "collector.num_steps=4",
            "total_env_steps=8",
            "log.wandb_mode=disabled",
            "log.progress=false",
            f"run_dir={tmp_path / 'run'}",
        ],
    )
    assert [w["target"] for w in cfg.env.wrappers] == [
        "gymnasium.wrappers:NormalizeObservation",
        "gymnasium.wrappers.NormalizeReward",
    ]
    trainer = build(cfg)
    env = trainer.collector.envs.envs[0]
    assert type(env).__name__ == "NormalizeReward" and type(env.env).__name__ == "NormalizeObservation"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the wrapped envs pickle into the checkpoint
        trainer.train()
    assert trainer.update == 1
