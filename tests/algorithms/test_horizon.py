"""rl_replay.algorithms.horizon: the first-observation gradient of an episode, through replay blocks,
and the trainer's ``log.horizon_every`` metric."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from _reference import plain_sequence
from tensordict import TensorDict

from rl_replay.agent import Policy
from rl_replay.agents.gru import GRUAgent
from rl_replay.agents.lru import LRUAgent
from rl_replay.agents.mlp import MLPAgent
from rl_replay.algorithms.horizon import episode_horizon
from rl_replay.config import load_config
from rl_replay.run.setup import build

OBS = gym.spaces.Box(-1.0, 1.0, shape=(4,), dtype=np.float32)
ACT = gym.spaces.Discrete(3)
T, N = 12, 3


def rollout_data(seed=0):
    """(T, N) rollout data: env 0 runs one episode over all rows, env 1 one of 5 rows then
    another of 7 (ending in an invalid autoreset row), env 2 starts mid-rollout."""
    g = torch.Generator().manual_seed(seed)
    is_first = torch.zeros(T, N, dtype=torch.bool)
    valid = torch.ones(T, N, dtype=torch.bool)
    is_first[0, 0] = True
    is_first[0, 1] = is_first[5, 1] = True
    valid[4, 1] = False  # the autoreset row after env 1's first episode (rows 0-3)
    is_first[8, 2] = True
    return TensorDict(
        observation=torch.randn(T, N, 4, generator=g),
        is_first=is_first,
        action=torch.randint(0, 3, (T, N), generator=g),
        valid=valid,
        batch_size=[T, N],
    )


def plain_first_obs_grad(agent, data, env, first, last, bptt_truncate=None):
    """The same gradient with plain autograd (no replay blocks); of the ``x`` part of a Dict
    observation."""
    episode = data[first : last + 1, env : env + 1].select("observation", "is_first", "action")
    obs0 = episode["observation"][0].clone()
    if isinstance(obs0, TensorDict):
        leaf = obs0["x"] = obs0["x"].requires_grad_(True)
    else:
        leaf = obs0 = obs0.requires_grad_(True)
    episode["observation"] = torch.cat([obs0.unsqueeze(0), episode["observation"][1:]])
    heads, _ = plain_sequence(agent, episode, agent.initial_state(1), bptt_truncate)
    log_prob = heads["log_prob"][-1].sum()
    (grad,) = torch.autograd.grad(log_prob, leaf, allow_unused=True)
    # The norm as episode_horizon takes it, so equal gradients give equal floats.
    return 0.0 if grad is None else math.sqrt(float(grad.double().pow(2).sum()))


AGENTS = {
    "gru": lambda: GRUAgent(OBS, ACT, hidden_size=8, encoder_sizes=(8,)),
    "lru": lambda: LRUAgent(OBS, ACT, hidden_size=8, encoder_sizes=(), readout_sizes=(8,), max_phase=0.0),
}


@pytest.mark.parametrize("name", sorted(AGENTS))
@pytest.mark.parametrize("bptt_truncate", [None, 4, 20])
def test_episode_horizon_equals_plain_autograd(name, bptt_truncate):
    torch.manual_seed(0)
    agent = AGENTS[name]()
    data = rollout_data()
    got = episode_horizon(Policy.of(agent), data, bptt_truncate)
    # The longest span: env 0, rows 0..11.
    assert got["horizon/steps"] == 11.0
    want = plain_first_obs_grad(agent, data, 0, 0, 11, bptt_truncate)
    if bptt_truncate == 4:
        assert got["horizon/grad_first_obs"] == want == 0.0  # cut 11 steps before the decision
    else:
        assert want > 0
        assert got["horizon/grad_first_obs"] == want  # replay is exact: bit-identical gradients


def test_episode_horizon_picks_the_longest_episode_and_skips_invalid_rows():
    torch.manual_seed(0)
    agent = AGENTS["gru"]()
    data = rollout_data()
    data["is_first"][:, 0] = False  # env 0 now starts no episode inside the rollout
    got = episode_horizon(Policy.of(agent), data)
    # env 1's second episode: rows 5..11 (6 steps); its first ends at the invalid row 4 -> 0..3.
    assert got["horizon/steps"] == 6.0
    assert got["horizon/grad_first_obs"] == plain_first_obs_grad(agent, data, 1, 5, 11)
    data["is_first"][:] = False
    assert episode_horizon(Policy.of(agent), data) == {}


def test_episode_horizon_leaves_grads_and_rng_as_they_were():
    torch.manual_seed(0)
    agent = AGENTS["gru"]()
    for p in agent.parameters():
        p.grad = torch.full_like(p, 0.5)
    before = [p.grad for p in agent.parameters()]
    rng = torch.get_rng_state()
    episode_horizon(Policy.of(agent), rollout_data())
    assert torch.equal(rng, torch.get_rng_state())
    for p, g in zip(agent.parameters(), before):
        assert p.grad is g and torch.all(g == 0.5)


def test_episode_horizon_without_recurrence_is_zero_past_the_first_step():
    # A feed-forward agent's last decision does not depend on the first observation.
    torch.manual_seed(0)
    agent = MLPAgent(OBS, ACT, hidden_sizes=(8,))
    got = episode_horizon(Policy.of(agent), rollout_data())
    assert got == {"horizon/grad_first_obs": 0.0, "horizon/steps": 11.0}


def read_metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def memory_cfg(run_dir, *extra):
    return load_config(
        None,
        [
            "env.id=rl_replay/MemoryCue-v0",
            "env.kwargs={delay: 6}",
            "env.num_envs=4",
            "collector.num_steps=8",
            "collector.mode=episode",
            "agent.target=lru",
            "agent.kwargs={hidden_size: 8, encoder_sizes: [], readout_sizes: [8], max_phase: 0.0}",
            "loss.algorithm=ppo",
            "ppo.num_minibatches=2",
            "ppo.epochs=2",
            "log.progress=false",
            "log.wandb_mode=disabled",
            "total_env_steps=128",
            "checkpoint.every=0",
            f"run_dir={run_dir}",
            *extra,
        ],
    )


def test_trainer_logs_the_horizon_without_changing_training(tmp_path):
    from rl_replay.rundir.checkpoint import load_checkpoint

    build(memory_cfg(tmp_path / "plain")).train()
    build(memory_cfg(tmp_path / "horizon", "log.horizon_every=2")).train()
    a, b = load_checkpoint(tmp_path / "plain"), load_checkpoint(tmp_path / "horizon")
    for k in a["agent"]:
        assert torch.equal(a["agent"][k], b["agent"][k]), k
    rows = read_metrics(tmp_path / "horizon")
    assert [r["update"] for r in rows if "horizon/grad_first_obs" in r] == [2, 4]
    for r in rows:
        if "horizon/grad_first_obs" in r:
            # The query (row 7) back to the cue (row 0), through the LRU: a real, finite gradient.
            assert r["horizon/steps"] == 7 and 0 < r["horizon/grad_first_obs"] < 1e3
            assert r["time/horizon_sec"] > 0
    truncated = tmp_path / "t3"
    build(memory_cfg(truncated, "log.horizon_every=1", "collector.bptt_truncate=3")).train()
    assert all(r["horizon/grad_first_obs"] == 0.0 for r in read_metrics(truncated))


def test_horizon_every_must_not_be_negative(tmp_path):
    with pytest.raises(ValueError, match="log.horizon_every"):
        memory_cfg(tmp_path / "x", "log.horizon_every=-1")


def test_episode_horizon_with_a_dict_observation_differentiates_its_float_parts():
    # A Dict observation: the float part gets the gradient, the uint8 part cannot.
    space = gym.spaces.Dict(
        {
            "x": gym.spaces.Box(-1.0, 1.0, shape=(3,), dtype=np.float32),
            "n": gym.spaces.Box(0, 255, shape=(2,), dtype=np.uint8),
        }
    )
    torch.manual_seed(0)
    agent = GRUAgent(space, ACT, hidden_size=8, encoder_sizes=(8,))
    data = rollout_data()
    g = torch.Generator().manual_seed(1)
    data["observation"] = TensorDict(
        x=torch.randn(T, N, 3, generator=g),
        n=torch.randint(0, 256, (T, N, 2), generator=g, dtype=torch.uint8),
        batch_size=[T, N],
    )
    got = episode_horizon(Policy.of(agent), data)
    # Plain autograd over env 0's rows 0..11, the float leaf of the first observation as the input.
    want = plain_first_obs_grad(agent, data, 0, 0, T - 1)
    assert got["horizon/steps"] == 11.0
    assert got["horizon/grad_first_obs"] == want > 0
    # Only integer observations: nothing to differentiate, no metric.
    data["observation"] = data["observation"].exclude("x")
    ints_only = GRUAgent(gym.spaces.Dict({"n": space["n"]}), ACT, hidden_size=8)
    assert episode_horizon(Policy.of(ints_only), data) == {}
