"""Collector: NEXT_STEP autoreset rows, valid masks, bootstrap values, GAE across episode
boundaries, episode mode, truncated BPTT, recurrent state resets and replay parity.

The Chain env (``rl_replay/Chain-v0``) is deterministic: observation channel 0 is
``t / length``, the ``t``-th step pays ``t + 1`` and the episode terminates after
``length`` steps, so every number below is computed by hand.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from _reference import plain_sequence
from conftest import assert_grads_match, collect_replayed
from tensordict import TensorDict
from torch import nn

from rl_replay.agent import ActionHead, Agent
from rl_replay.agents.gru import GRUAgent
from rl_replay.agents.lstm import LSTMAgent
from rl_replay.agents.mlp import MLPAgent
from rl_replay.algorithms.a2c import A2C
from rl_replay.algorithms.losses import a2c_loss, total_loss
from rl_replay.config import Config
from rl_replay.envs.chain import ChainEnv
from rl_replay.rollout.collector import Collector
from rl_replay.rollout.environment import make_vector_env
from rl_replay.rollout.sequence import step_inputs

T_, F_ = True, False


class LinearValueAgent(Agent):
    """Uniform policy and ``V(obs) = w * obs[0] + b``: every output is known in advance."""

    def __init__(self, observation_space, action_space, w: float = 3.0, b: float = 1.0):
        super().__init__(observation_space, action_space)
        self.head = ActionHead(action_space, self.obs_dim)
        nn.init.zeros_(self.head.linear.weight)  # logits 0: log_prob = log(1/2) exactly
        self.critic = nn.Linear(self.obs_dim, 1)
        with torch.no_grad():
            self.critic.weight.zero_()
            self.critic.weight[0, 0] = w
            self.critic.bias.fill_(b)

    def forward(self, observation, state, is_first):
        return self.output(dist=self.head(observation), value=self.critic(observation).squeeze(-1), state=state)


def chain_collector(length, *, max_episode_steps=None, num_steps=6, num_envs=2, w=3.0, b=1.0, **kw):
    envs = make_vector_env(
        "rl_replay/Chain-v0", num_envs, kwargs={"length": length}, max_episode_steps=max_episode_steps
    )
    agent = LinearValueAgent(envs.single_observation_space, envs.single_action_space, w=w, b=b)
    return Collector(envs, agent, num_steps=num_steps, seed=0, **kw), agent


def column(data, key, env=0):
    x = data[key][:, env]
    if key == "observation":
        x = x[:, 0]
    return x.detach()


def assert_column(data, key, expected, *, both_envs=True):
    envs = range(data.batch_size[1]) if both_envs else [0]
    for i in envs:
        got = column(data, key, i)
        exp = torch.tensor(expected, dtype=got.dtype)
        if got.dtype == torch.bool:
            assert torch.equal(got, exp), f"{key}[env {i}]: {got.tolist()} != {expected}"
        else:
            torch.testing.assert_close(got, exp, rtol=0, atol=1e-6, msg=f"{key}[env {i}]")


# ----------------------------------------------------------------- rows, flags, values
def test_fixed_rollout_with_termination():
    collector, agent = chain_collector(3)  # V(x) = 3x + 1, obs x = t/3
    r, _ = collect_replayed(collector)
    d = r.data
    assert d.batch_size == torch.Size([6, 2])
    assert_column(d, "observation", [0, 1 / 3, 2 / 3, 1.0, 0, 1 / 3])  # row 3: final obs
    assert_column(d, "reward", [1, 2, 3, 0, 1, 2])
    assert_column(d, "terminated", [F_, F_, T_, F_, F_, F_])
    assert_column(d, "truncated", [F_] * 6)
    assert_column(d, "valid", [T_, T_, T_, F_, T_, T_])
    assert_column(d, "is_first", [T_, F_, F_, F_, T_, F_])
    assert_column(d, "value", [1, 2, 3, 4, 1, 2])
    assert_column(d, "next_value", [2, 3, 4, 1, 2, 3])  # last: bootstrap V(2/3)
    assert torch.equal(d["next_value"][:-1], d["value"][1:].detach())
    assert not d["next_value"].requires_grad
    assert d["value"].requires_grad and d["log_prob"].requires_grad
    torch.testing.assert_close(d["log_prob"].detach(), torch.full((6, 2), float(np.log(0.5))))
    assert r.episode_returns == [6.0, 6.0] and r.episode_lengths == [3, 3]
    assert r.env_steps == 12

    # Fixed mode carries env state, episode return and length across rollouts. Without a
    # forward the policy runs without a graph: the same rows, nothing attached.
    r2 = collector.collect()
    d2 = r2.data
    assert not any(d2[k].requires_grad for k in ("log_prob", "entropy", "value"))
    assert_column(d2, "observation", [2 / 3, 1.0, 0, 1 / 3, 2 / 3, 1.0])
    assert_column(d2, "reward", [3, 0, 1, 2, 3, 0])
    assert_column(d2, "terminated", [T_, F_, F_, F_, T_, F_])
    assert_column(d2, "valid", [T_, F_, T_, T_, T_, F_])
    assert_column(d2, "is_first", [F_, F_, T_, F_, F_, F_])
    assert_column(d2, "next_value", [4, 1, 2, 3, 4, 1])  # last: V(reset obs 0)
    # The episode started in rollout 1 (1 + 2) and finished in rollout 2 (+ 3).
    assert r2.episode_returns == [6.0] * 4 and r2.episode_lengths == [3] * 4


def test_fixed_rollout_with_truncation():
    collector, agent = chain_collector(5, max_episode_steps=3, w=10.0)  # V(x) = 10x + 1
    r = collector.collect()
    d = r.data
    assert_column(d, "observation", [0, 0.2, 0.4, 0.6, 0, 0.2])  # row 3: final obs 0.6
    assert_column(d, "reward", [1, 2, 3, 0, 1, 2])
    assert_column(d, "terminated", [F_] * 6)
    assert_column(d, "truncated", [F_, F_, T_, F_, F_, F_])
    assert_column(d, "valid", [T_, T_, T_, F_, T_, T_])
    assert_column(d, "is_first", [T_, F_, F_, F_, T_, F_])
    assert_column(d, "value", [1, 3, 5, 7, 1, 3])
    assert_column(d, "next_value", [3, 5, 7, 1, 3, 5])
    assert torch.equal(d["next_value"][:-1], d["value"][1:].detach())
    # The truncated row bootstraps from V(final observation), computed with the agent.
    final_obs = torch.tensor([[0.6, 0.0, 0.0]])
    with torch.no_grad():
        v_final = agent(**step_inputs(final_obs, agent.initial_state(1), torch.zeros(1, dtype=torch.bool)))[
            "outputs", "value"
        ][0]
    assert torch.equal(d["next_value"][2], v_final.expand(2))
    assert torch.equal(d["observation"][3], final_obs.expand(2, 3))
    assert r.episode_returns == [6.0, 6.0] and r.episode_lengths == [3, 3]


# ---------------------------------------------------------------------------- GAE
@pytest.mark.parametrize(
    "length, max_steps, w, advantages, returns",
    [
        # values 1,2,3,4,1,2; delta 1,1.5,0,-,1,1.5; A_t = delta_t + 0.25 A_{t+1} inside episodes
        (3, None, 3.0, [1.375, 1.5, 0.0, 0.0, 1.375, 1.5], [2.375, 3.5, 3.0, 0.0, 2.375, 3.5]),
        # values 1,3,5,7,1,3; every delta 1.5 (the truncated row bootstraps V(0.6) = 7)
        (5, 3, 10.0, [1.96875, 1.875, 1.5, 0.0, 1.875, 1.5], [2.96875, 4.875, 6.5, 0.0, 2.875, 4.5]),
    ],
    ids=["terminated", "truncated"],
)
def test_gae_hand_values_and_no_gradient_to_invalid_rows(length, max_steps, w, advantages, returns):
    collector, _ = chain_collector(length, max_episode_steps=max_steps, w=w)
    d = collect_replayed(collector)[0].data
    valid = d["valid"]
    n_valid = valid.sum().item()
    assert n_valid == 10
    terms = a2c_loss(d, gamma=0.5, gae_lambda=0.5, value_coef=1.0, entropy_coef=0.1, normalize_advantages=False)
    # loss_policy = -mean_valid(A * log_prob)  =>  d/dlog_prob = -A / n_valid
    g_lp, g_v, g_ent = torch.autograd.grad(
        [terms["loss_policy"], terms["loss_value"], terms["loss_entropy"]],
        [d["log_prob"], d["value"], d["entropy"]],
    )
    adv = -g_lp * n_valid
    # loss_value = 0.5 * mean_valid((V - R)^2)  =>  d/dV = (V - R) / n_valid
    ret = torch.where(valid, d["value"].detach() - g_v * n_valid, 0.0)
    exp_adv = torch.tensor(advantages).unsqueeze(1).expand(6, 2)
    exp_ret = torch.tensor(returns).unsqueeze(1).expand(6, 2)
    torch.testing.assert_close(adv, exp_adv, rtol=0, atol=1e-5)
    torch.testing.assert_close(ret, exp_ret, rtol=0, atol=1e-5)
    torch.testing.assert_close(terms["advantage_mean"], exp_adv[valid].mean(), rtol=0, atol=1e-5)
    torch.testing.assert_close(terms["return_mean"], exp_ret[valid].mean(), rtol=0, atol=1e-5)
    # Nothing is trained on the autoreset rows: their gradients are exactly zero.
    for g in (g_lp, g_v, g_ent):
        assert torch.equal(g[~valid], torch.zeros_like(g[~valid]))
    assert (g_ent[valid] != 0).all() and (g_lp[valid] != 0).sum() >= 8


# ---------------------------------------------------------------------- episode mode
def two_length_envs():
    return gym.vector.SyncVectorEnv([lambda: ChainEnv(length=2), lambda: ChainEnv(length=4)])


def test_episode_mode_restarts_masks_and_stops_early():
    envs = two_length_envs()
    agent = LinearValueAgent(envs.single_observation_space, envs.single_action_space)
    collector = Collector(envs, agent, num_steps=10, mode="episode", seed=0)
    for _ in range(2):  # the second rollout restarts every env (env 0 was mid-episode)
        r, _ = collect_replayed(collector)
        d = r.data
        assert d.batch_size == torch.Size([4, 2])  # stopped when env 1 finished, not at 10
        assert torch.equal(d["valid"][:, 0], torch.tensor([T_, T_, F_, F_]))
        assert torch.equal(d["valid"][:, 1], torch.tensor([T_, T_, T_, T_]))
        assert torch.equal(d["is_first"][0], torch.tensor([T_, T_]))
        assert torch.equal(d["observation"][0, :, 0], torch.zeros(2))
        torch.testing.assert_close(d["observation"][:, 1, 0], torch.tensor([0, 0.25, 0.5, 0.75]))
        assert torch.equal(d["reward"][:, 1], torch.tensor([1.0, 2, 3, 4]))
        assert torch.equal(d["terminated"][:, 0], torch.tensor([F_, T_, F_, F_]))
        assert torch.equal(d["terminated"][:, 1], torch.tensor([F_, F_, F_, T_]))
        assert sorted(zip(r.episode_returns, r.episode_lengths)) == [(3.0, 2), (10.0, 4)]
        assert r.env_steps == 8
        terms = a2c_loss(d, gamma=0.5, gae_lambda=0.5, normalize_advantages=False)
        (g,) = torch.autograd.grad(terms["loss_policy"], d["log_prob"])
        assert torch.equal(g[:, 0][2:], torch.zeros(2))


def test_episode_mode_step_cap():
    envs = two_length_envs()
    agent = LinearValueAgent(envs.single_observation_space, envs.single_action_space)
    collector = Collector(envs, agent, num_steps=3, mode="episode", seed=0)
    r = collector.collect()
    assert r.data.batch_size == torch.Size([3, 2])
    assert torch.equal(r.data["valid"][:, 1], torch.ones(3, dtype=torch.bool))
    assert r.episode_returns == [3.0] and r.episode_lengths == [2]
    # env 1 is cut at the cap: bootstrap from V(obs after the last row) = V(0.75)
    torch.testing.assert_close(r.data["next_value"][-1, 1], torch.tensor(3 * 0.75 + 1))
    r = collector.collect()
    assert torch.equal(r.data["observation"][0, :, 0], torch.zeros(2))
    assert r.episode_returns == [3.0]


# ------------------------------------------------------------------- recurrent state
def gru_collector(length, num_steps, bptt_truncate=None, num_envs=2):
    torch.manual_seed(0)
    envs = make_vector_env("rl_replay/Chain-v0", num_envs, kwargs={"length": length})
    agent = GRUAgent(envs.single_observation_space, envs.single_action_space, hidden_size=8, encoder_sizes=(8,))
    collector = Collector(envs, agent, num_steps=num_steps, bptt_truncate=bptt_truncate, seed=0)
    # Start from a leaf state that is *not* reset at row 0, so its gradient is observable.
    collector._reset(0)
    h0 = torch.randn(num_envs, 8, requires_grad=True)
    collector._state = TensorDict(h=h0, batch_size=[num_envs])
    collector._is_first = torch.zeros(num_envs, dtype=torch.bool)
    return collector, agent, h0


def grad_to_h0(length, num_steps, bptt_truncate, row):
    collector, agent, h0 = gru_collector(length, num_steps, bptt_truncate)
    d = collect_replayed(collector)[0].data
    loss = d["value"][row].sum() + d["log_prob"][row].sum()
    loss.backward()
    param_grad = sum(p.grad.abs().sum() for p in agent.parameters() if p.grad is not None)
    assert param_grad > 0  # the loss does train the agent
    return torch.zeros_like(h0) if h0.grad is None else h0.grad


def test_bptt_truncate_cuts_gradient_to_initial_state():
    # K = 2, T = 4: blocks {0, 1} and {2, 3}; a loss on step 3 cannot reach h0.
    assert torch.equal(grad_to_h0(50, 4, 2, row=3), torch.zeros(2, 8))
    # Inside the first block the gradient flows ...
    assert grad_to_h0(50, 4, 2, row=1).abs().sum() > 0
    # ... and without truncation it flows through the whole rollout.
    assert grad_to_h0(50, 4, None, row=3).abs().sum() > 0


def test_recurrent_state_reset_at_episode_start():
    # length 3: rows 0-2 episode 1 (terminates at 2), row 3 autoreset, row 4 starts episode 2
    g_after = grad_to_h0(3, 6, None, row=4)
    assert torch.equal(g_after, torch.zeros(2, 8))
    assert torch.equal(grad_to_h0(3, 6, None, row=5), torch.zeros(2, 8))
    # The autoreset row still belongs to the old episode's state (it computes V(final obs)).
    assert grad_to_h0(3, 6, None, row=3).abs().sum() > 0


# --------------------------------------------------------------------- replay parity
def plain_autograd_update(agent, data, initial_state, cfg):
    """The same A2C update with ordinary autograd over the stored rollout."""
    heads, state = plain_sequence(agent, data, initial_state)
    value = heads["value"]
    td = TensorDict(
        reward=data["reward"],
        terminated=data["terminated"],
        truncated=data["truncated"],
        valid=data["valid"],
        log_prob=heads["log_prob"],
        entropy=heads["entropy"],
        value=value,
        next_value=torch.cat([value[1:].detach(), data["next_value"][-1:]]),
        batch_size=data.batch_size,
    )
    terms = A2C.loss(td, cfg)
    total_loss(terms).backward()
    return td, terms, state


@pytest.mark.parametrize("agent_name", ["mlp", "gru", "lstm"])
def test_replay_gradient_equals_plain_autograd(agent_name):
    torch.manual_seed(3)
    envs = make_vector_env("CartPole-v1", 4, max_episode_steps=15)
    spaces = envs.single_observation_space, envs.single_action_space
    if agent_name == "mlp":
        agent = MLPAgent(*spaces, hidden_sizes=(32, 32))
    elif agent_name == "gru":
        agent = GRUAgent(*spaces, hidden_size=32, encoder_sizes=(32,))
    else:
        agent = LSTMAgent(*spaces, hidden_size=32, encoder_sizes=(32,))
    cfg = Config()
    collector = Collector(envs, agent, num_steps=16, seed=1)

    collector.collect()  # a second rollout starts mid-episode with a carried state
    start_state = collector._state.clone()
    rollout, accumulator = collect_replayed(collector)
    assert set(rollout.start_state.keys()) == set(start_state.keys())
    assert all(torch.equal(rollout.start_state[k], start_state[k]) for k in start_state.keys())
    d = rollout.data
    assert d.batch_size == torch.Size([16, 4])
    # The rollout crosses episode ends of both kinds.
    assert d["truncated"].any() and d["terminated"].any() and (~d["valid"]).any()
    assert d["is_first"][1:].any()
    agent.zero_grad(set_to_none=True)
    terms = A2C.loss(d, cfg)
    total_loss(terms).backward()
    assert accumulator.blocks_replayed == 16
    replay_grads = {n: p.grad.clone() for n, p in agent.named_parameters()}
    final_state = collector._state

    agent.zero_grad(set_to_none=True)
    td, plain_terms, plain_state = plain_autograd_update(agent, d.detach(), start_state, cfg)
    for key in ("log_prob", "entropy", "value"):
        torch.testing.assert_close(d[key].detach(), td[key].detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(d["next_value"][:-1], td["next_value"][:-1], rtol=1e-6, atol=1e-6)
    for key in plain_terms.keys():
        torch.testing.assert_close(terms[key].detach(), plain_terms[key].detach(), rtol=1e-5, atol=1e-6)
    if agent_name == "gru":
        torch.testing.assert_close(final_state["h"], plain_state["h"].detach())
    # The bootstrap of the last row is V(next obs) with the carried state.
    with torch.no_grad():
        boot = agent(**step_inputs(collector._obs, collector._state, collector._is_first))["outputs", "value"][0]
    torch.testing.assert_close(d["next_value"][-1], boot)
    assert_grads_match(
        replay_grads, {n: p.grad for n, p in agent.named_parameters()}, f"parity_{agent_name}", rtol=1e-5, atol=1e-6
    )


# ------------------------------------------------------------------- action spaces
class MultiDiscreteEnv(gym.Env):
    """Box(2) observations, MultiDiscrete([3, 2]) actions, reward = sum of the action."""

    def __init__(self):
        self.observation_space = gym.spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
        self.action_space = gym.spaces.MultiDiscrete([3, 2])
        self._t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t = 0
        return np.zeros(2, dtype=np.float32), {}

    def step(self, action):
        assert self.action_space.contains(np.asarray(action)), action
        self._t += 1
        obs = np.full(2, self._t / 4, dtype=np.float32)
        return obs, float(np.sum(action)), self._t == 4, False, {}


@pytest.mark.parametrize("kind", ["box", "multidiscrete"])
def test_box_and_multidiscrete_actions(kind):
    torch.manual_seed(0)
    if kind == "box":
        envs = make_vector_env("Pendulum-v1", 3)
        action_shape = (1,)
    else:
        envs = gym.vector.SyncVectorEnv([MultiDiscreteEnv for _ in range(3)])
        action_shape = (2,)
    agent = MLPAgent(envs.single_observation_space, envs.single_action_space, hidden_sizes=(8,))
    collector = Collector(envs, agent, num_steps=6, seed=0)
    d = collect_replayed(collector)[0].data
    assert d["log_prob"].shape == (6, 3)
    assert d["entropy"].shape == (6, 3)
    assert d["action"].shape == (6, 3, *action_shape)
    if kind == "multidiscrete":
        assert set(d["action"][..., 0].unique().tolist()) <= {0, 1, 2}
        assert set(d["action"][..., 1].unique().tolist()) <= {0, 1}
        assert torch.equal(d["valid"][:, 0], torch.tensor([T_, T_, T_, T_, F_, T_]))
        valid = d["valid"]
        assert torch.equal(d["reward"][valid], d["action"][valid].sum(-1).float())
    total_loss(a2c_loss(d)).backward()
    grads = [p.grad for p in agent.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
