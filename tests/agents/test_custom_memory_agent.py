"""docs/memory_transformers.md's "Write your own memory agent": the code in the page, run.

The example is read from the page (the python block after its marker) so the page cannot drift
from what works: its sequence call equals its one-step calls, replay of its blocks equals plain
autograd over the same calls bit for bit, and it trains two PPO updates from a config naming it
by import path (the trainer checks the agent contract first).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import assert_grads_match
from tensordict import TensorDict

from rl_replay.agent import Policy
from rl_replay.algorithms.stored import replay_sequence
from rl_replay.engine import GradientAccumulator

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "memory_transformers.md"


def example_source() -> str:
    text = PAGE.read_text()
    m = re.search(r"<!-- example: custom memory agent -->\n```python\n(.*?)```", text, re.S)
    assert m, "the example block is missing from docs/memory_transformers.md"
    return m.group(1)


def example_class():
    namespace: dict = {}
    exec(compile(example_source(), str(PAGE), "exec"), namespace)
    return namespace["TinyAttentionAgent"]


SPACE = gym.spaces.Box(-1.0, 1.0, (5,), np.float32)
T, N = 9, 3


def data():
    g = torch.Generator().manual_seed(0)
    is_first = torch.zeros(T, N, dtype=torch.bool)
    is_first[0] = is_first[4, 1] = True
    return TensorDict(
        observation=torch.randn(T, N, 5, generator=g),
        is_first=is_first,
        action=torch.randint(0, 3, (T, N), generator=g),
        batch_size=[T, N],
    )


def test_the_example_steps_and_sequences_alike():
    torch.manual_seed(0)
    agent = example_class()(SPACE, gym.spaces.Discrete(3), width=8, window=3)
    d = data()
    with torch.no_grad():
        whole = agent(observation=d["observation"], state=agent.initial_state(N), is_first=d["is_first"])
        state, values = agent.initial_state(N), []
        for t in range(T):
            out = agent(observation=d["observation"][t : t + 1], state=state, is_first=d["is_first"][t : t + 1])
            values.append(out["outputs", "value"][0])
            state = out["state"]
    torch.testing.assert_close(whole["outputs", "value"], torch.stack(values), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(whole["state", "past"], state["past"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_replay_of_the_example_equals_plain_autograd_bit_for_bit(k):
    torch.manual_seed(0)
    agent = example_class()(SPACE, gym.spaces.Discrete(3), width=8, window=3)
    d = data()

    def grads(run):
        agent.zero_grad(set_to_none=True)
        out = run()
        (out["log_prob"].sum() + out["value"].square().sum()).backward()
        return {n: p.grad.clone() for n, p in agent.named_parameters()}

    def plain():
        state, outs = agent.initial_state(N), []
        for t0 in range(0, T, k):
            o = agent(observation=d["observation"][t0 : t0 + k], state=state, is_first=d["is_first"][t0 : t0 + k])
            outs.append(o["outputs"])
            state = o["state"]
        stacked = torch.cat(outs)
        dist = agent.distribution(stacked)
        return TensorDict(log_prob=dist.log_prob(d["action"]), value=stacked["value"], batch_size=[T, N])

    acc = GradientAccumulator()
    got = grads(lambda: replay_sequence(Policy.of(agent), d, agent.initial_state(N), acc, None, k))
    assert acc.blocks_replayed == -(-T // k)
    assert_grads_match(got, grads(plain), "custom-memory-agent", rtol=0, atol=0)


def test_the_example_trains_from_a_config(tmp_path):
    (tmp_path / "my_agents.py").write_text(example_source())
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "train.py"),
        "--config",
        str(ROOT / "configs" / "ppo_memory_gru.yaml"),
        "agent.target=my_agents:TinyAttentionAgent",
        "agent.kwargs={width: 16, window: 8}",
        "env.num_envs=4",
        "env.kwargs={delay: 8}",
        "collector.num_steps=10",
        "ppo.num_minibatches=2",
        "total_env_steps=80",
        "checkpoint.every=0",
        "eval.every=0",
        "log.progress=false",
        "log.wandb_mode=disabled",
        f"run_dir={run}",
    ]
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "finished 2 updates, 80 env steps" in proc.stdout + proc.stderr
