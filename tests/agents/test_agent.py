"""Agent contract: action heads per action space, space checks and agent loading errors."""

from __future__ import annotations

import sys

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict

from rl_replay.agent import (
    AGENTS,
    ActionHead,
    Agent,
    MultiCategorical,
    StepwiseAgent,
    build_agent,
    canonical_agent_target,
    load_agent_class,
)
from rl_replay.agents.gru import GRUAgent
from rl_replay.agents.lstm import LSTMAgent
from rl_replay.agents.mlp import MLPAgent
from rl_replay.algorithms.stored import OneStep
from rl_replay.errors import SetupError

OBS = gym.spaces.Box(-1.0, 1.0, shape=(4,), dtype=np.float32)


def head_and_dist(space, batch=5, features=6):
    torch.manual_seed(0)
    head = ActionHead(space, features, init_std=1.0)
    x = torch.randn(batch, features)
    params = head(x)
    return head, params, head.distribution(params)


def test_discrete_head():
    head, params, dist = head_and_dist(gym.spaces.Discrete(3))
    assert isinstance(dist, torch.distributions.Categorical)
    assert params["logits"].shape == (5, 3)
    a = dist.sample()
    assert a.shape == (5,)
    assert dist.log_prob(a).shape == (5,) and dist.entropy().shape == (5,)
    expected = torch.log_softmax(params["logits"], -1).gather(-1, a[:, None]).squeeze(-1)
    torch.testing.assert_close(dist.log_prob(a), expected)


def test_multidiscrete_head_log_prob_is_sum_of_parts():
    nvec = (3, 2, 4)
    head, params, dist = head_and_dist(gym.spaces.MultiDiscrete(list(nvec)))
    assert isinstance(dist, MultiCategorical)
    logits = params["logits"]
    assert logits.shape == (5, sum(nvec))
    a = dist.sample()
    assert a.shape == (5, 3)
    for j, n in enumerate(nvec):
        assert ((a[:, j] >= 0) & (a[:, j] < n)).all()
    lp, ent = dist.log_prob(a), dist.entropy()
    assert lp.shape == (5,) and ent.shape == (5,)
    parts = [torch.distributions.Categorical(logits=part) for part in logits.split(nvec, dim=-1)]
    torch.testing.assert_close(lp, sum(p.log_prob(a[:, j]) for j, p in enumerate(parts)))
    torch.testing.assert_close(ent, sum(p.entropy() for p in parts))
    # Hand check of one entry from the raw logits.
    by_hand = sum(torch.log_softmax(part[0], -1)[a[0, j]] for j, part in enumerate(logits.split(nvec, -1)))
    torch.testing.assert_close(lp[0], by_hand)
    assert torch.equal(dist.mode, torch.stack([p.probs.argmax(-1) for p in parts], -1))


def test_box_head():
    space = gym.spaces.Box(-2.0, 2.0, shape=(2, 3), dtype=np.float32)
    head, params, dist = head_and_dist(space)
    assert params["loc"].shape == (5, 6) and params["scale"].shape == (5, 6)
    a = dist.sample()
    assert a.shape == (5, 6)
    lp, ent = dist.log_prob(a), dist.entropy()
    assert lp.shape == (5,) and ent.shape == (5,)
    normal = torch.distributions.Normal(params["loc"], params["scale"])
    torch.testing.assert_close(lp, normal.log_prob(a).sum(-1))
    # The log-std is a learned parameter that gets gradient through forward.
    lp.sum().backward()
    assert head.log_std.grad is not None and head.log_std.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "space",
    [
        gym.spaces.Text(5),
        gym.spaces.Dict({"a": gym.spaces.Discrete(2)}),
        gym.spaces.Tuple((gym.spaces.Discrete(2), gym.spaces.Discrete(3))),
    ],
    ids=["text", "dict", "tuple"],
)
def test_unsupported_action_space(space):
    with pytest.raises(SetupError, match="cannot handle action space"):
        ActionHead(space, 4)
    with pytest.raises(SetupError, match="MLPAgent cannot handle action space"):
        MLPAgent(OBS, space)


def test_multidimensional_multidiscrete_rejected():
    with pytest.raises(SetupError, match="1-D MultiDiscrete"):
        GRUAgent(OBS, gym.spaces.MultiDiscrete(np.array([[2, 3], [4, 5]])))


@pytest.mark.parametrize(
    "obs_space, obs_dim",
    [(gym.spaces.Discrete(4), 4), (gym.spaces.Dict({"x": OBS}), 4), (gym.spaces.MultiBinary(3), 3)],
    ids=["discrete", "dict", "multibinary"],
)
def test_non_box_observation_space(obs_space, obs_dim):
    # Converted by rl_replay.spaces (one-hot, nested TensorDict, float); obs_dim is the flat width.
    assert MLPAgent(obs_space, gym.spaces.Discrete(2)).obs_dim == obs_dim


@pytest.mark.parametrize(
    "obs_space", [gym.spaces.Text(4), gym.spaces.Dict({"t": gym.spaces.Text(4)})], ids=["text", "dict_of_text"]
)
def test_unsupported_observation_space(obs_space):
    with pytest.raises(SetupError, match="MLPAgent cannot handle observation space Text"):
        MLPAgent(obs_space, gym.spaces.Discrete(2))


@pytest.mark.parametrize(
    "target, match",
    [
        ("rl_replay.agents.mlp:", "must look like 'package.module:Name'"),
        ("my pkg:Agent", "must look like 'package.module:Name'"),
        (
            "gpt",
            r"'gpt' is not a built-in name \(one of gru, gtrxl, lru, lstm, mingru, mlp, transformer\); "
            r"name your own class as 'package.module:Name'",
        ),
        ("no_such_module_xyz.sub:Agent", "cannot import module 'no_such_module_xyz.sub'"),
        ("rl_replay.agents.mlp:NoSuchAgent", "module 'rl_replay.agents.mlp' has no attribute 'NoSuchAgent'"),
        ("agents.mlp:NoSuchAgent", "module 'rl_replay.agents.mlp' has no attribute 'NoSuchAgent'"),
        ("rl_replay.agents.mlp:mlp", "not a subclass of rl_replay.Agent"),
        ("torch.nn:Linear", "not a subclass of rl_replay.Agent"),
    ],
    ids=[
        "no-name",
        "bad-module",
        "unknown-short-name",
        "missing-module",
        "missing-attribute",
        "missing-attribute-old-path",
        "function",
        "other-class",
    ],
)
def test_load_agent_class_errors(target, match):
    with pytest.raises(SetupError, match=match):
        load_agent_class(target)


@pytest.mark.parametrize(
    "target",
    [
        "gru",
        "rl_replay.agents.gru:GRUAgent",
        "rl_replay.agents.gru.GRUAgent",
        "agents.gru:GRUAgent",
        "agents.gru.GRUAgent",
    ],
    ids=["short", "path", "dotted", "old-path", "old-dotted"],
)
def test_every_spelling_of_an_agent_is_the_same_class(target):
    # Configs written before the short names (and before the rl_replay.agents package) keep working.
    assert load_agent_class(target) is GRUAgent
    assert canonical_agent_target(target) == "rl_replay.agents.gru:GRUAgent"


def test_every_short_name_is_a_reference_agent():
    for name, path in AGENTS.items():
        cls = load_agent_class(name)
        assert cls is load_agent_class(path) and cls.__module__ == "rl_replay.agents." + name


def test_an_own_package_called_agents_is_not_renamed(tmp_path, monkeypatch):
    # Only the modules the old top-level package had map to rl_replay.agents.
    (tmp_path / "agents").mkdir()
    (tmp_path / "agents" / "__init__.py").write_text("")
    (tmp_path / "agents" / "mine.py").write_text("from rl_replay.agents.mlp import MLPAgent as Mine\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    # Another test may have imported a different top-level 'agents' (e.g. through a
    # namespace package on sys.path): this test's own package must be the one found.
    for name in [m for m in sys.modules if m == "agents" or m.startswith("agents.")]:
        monkeypatch.delitem(sys.modules, name)
    try:
        assert load_agent_class("agents.mine:Mine") is MLPAgent
        assert canonical_agent_target("agents.mine:Mine") == "agents.mine:Mine"
    finally:
        for name in ("agents", "agents.mine"):
            sys.modules.pop(name, None)


def test_load_and_build_agent():
    assert load_agent_class("gru") is GRUAgent
    agent = build_agent("mlp", {"hidden_sizes": [8]}, OBS, gym.spaces.Discrete(2))
    assert isinstance(agent, MLPAgent) and agent.actor[0].out_features == 8
    with pytest.raises(SetupError, match="rejected agent.kwargs"):
        build_agent("mlp", {"bogus": 1}, OBS, gym.spaces.Discrete(2))


@pytest.mark.parametrize("cls", [MLPAgent, GRUAgent, LSTMAgent])
def test_reference_agents_follow_the_contract(cls):
    agent = cls(OBS, gym.spaces.Discrete(3))
    state = agent.initial_state(5)
    assert state.batch_size == torch.Size([5])
    out = agent(observation=torch.randn(2, 5, 4), state=state, is_first=torch.ones(2, 5, dtype=torch.bool))
    assert isinstance(out, TensorDict) and out.batch_size == torch.Size([]) and set(out.keys()) == {"outputs", "state"}
    assert out["outputs"].batch_size == (2, 5) and out["outputs", "value"].shape == (2, 5)
    assert agent.distribution(out["outputs"]).sample().shape == (2, 5)
    assert set(out["state"].keys()) == set(state.keys()) and out["state"].batch_size == (5,)


RECURRENT_KEYS = [
    f"{part}.{name}"
    for part, names in [
        ("encoder.0", ["weight", "bias"]),
        ("core", ["weight_ih", "weight_hh", "bias_ih", "bias_hh"]),
        ("critic_encoder.0", ["weight", "bias"]),
        ("critic_core", ["weight_ih", "weight_hh", "bias_ih", "bias_hh"]),
        ("actor_mlp.0", ["weight", "bias"]),
        ("critic_mlp.0", ["weight", "bias"]),
        ("head.linear", ["weight", "bias"]),
        ("value", ["weight", "bias"]),
    ]
    for name in names
]


@pytest.mark.parametrize(
    "cls, state_keys, param_sum, outputs",
    [
        (GRUAgent, ["h", "h_critic"], 22.043388, [0.764346, 0.009361, 0.375036, -0.01484, 0.678747, 0.001616]),
        (
            LSTMAgent,
            ["h", "c", "h_critic", "c_critic"],
            1.226208,
            [0.600105, -0.02189, 1.01284, 0.010656, -0.058101, 0.004572],
        ),
    ],
    ids=["gru", "lstm"],
)
def test_recurrent_agents_keep_their_parameters_and_outputs(cls, state_keys, param_sum, outputs):
    """Checkpoints hold these parameter names and state keys, and a seeded agent (separate
    critic, skip path, head layers, chrono init) computes these numbers, as it did before
    GRUAgent and LSTMAgent shared agents/recurrent.py: training stays identical."""
    torch.manual_seed(0)
    agent = cls(
        OBS,
        gym.spaces.Discrete(3),
        hidden_size=6,
        encoder_sizes=(5,),
        separate_critic=True,
        skip=True,
        head_sizes=(7,),
        chrono_t_max=16,
    )
    assert list(agent.state_dict()) == RECURRENT_KEYS
    assert sum(p.double().sum().item() for p in agent.parameters()) == pytest.approx(param_sum, abs=1e-5)
    g = torch.Generator().manual_seed(1)
    state, got = agent.initial_state(3), []
    assert list(state.keys()) == state_keys
    for t in range(3):
        out = OneStep(agent)(
            observation=torch.randn(3, 4, generator=g), state=state, is_first=torch.tensor([t == 0, False, t == 1])
        )
        state = out["state"]
        got += [out["value"].sum().item(), out["dist", "logits"].sum().item()]
    assert list(state.keys()) == state_keys
    assert got == pytest.approx(outputs, abs=1e-5)


def test_reset_state_blocks_gradient():
    h = torch.randn(3, 4, requires_grad=True)
    is_first = torch.tensor([True, False, True])
    out = Agent.reset_state(h, is_first)
    assert torch.equal(out[0], torch.zeros(4)) and torch.equal(out[1], h[1])
    out.sum().backward()
    assert torch.equal(h.grad, torch.tensor([0.0, 1.0, 0.0]).unsqueeze(1).expand(3, 4))


def test_base_forward_not_implemented():
    agent = Agent(OBS, gym.spaces.Discrete(2))
    with pytest.raises(NotImplementedError, match="must implement forward"):
        agent(observation=torch.zeros(1, 4), state=agent.initial_state(1), is_first=torch.ones(1, dtype=torch.bool))


def test_agent_is_exported_from_the_package():
    import rl_replay
    from rl_replay import Agent as Exported

    assert Exported is Agent is rl_replay.Agent
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        rl_replay.Nope  # noqa: B018


@pytest.mark.parametrize("cls, keys", [(GRUAgent, {"h", "h_critic"}), (LSTMAgent, {"h", "c", "h_critic", "c_critic"})])
def test_separate_critic_keeps_value_and_policy_gradients_apart(cls, keys):
    torch.manual_seed(0)
    agent = cls(OBS, gym.spaces.Discrete(3), hidden_size=8, encoder_sizes=[8], separate_critic=True)
    state = agent.initial_state(4)
    assert set(state.keys()) == keys
    obs = torch.randn(4, *OBS.shape)
    out = OneStep(agent)(observation=obs, state=state, is_first=torch.zeros(4, dtype=torch.bool))
    out = OneStep(agent)(observation=obs, state=out["state"], is_first=torch.tensor([True, False, False, False]))
    out["value"].sum().backward()
    grads = {n: p.grad for n, p in agent.named_parameters()}
    assert all(grads[n] is None for n in grads if n.startswith(("encoder.", "core.", "head.")))
    assert all(grads[n] is not None and grads[n].abs().sum() > 0 for n in grads if n.startswith("critic_"))


@pytest.mark.parametrize("cls", [GRUAgent, LSTMAgent])
def test_recurrent_activation_must_be_known(cls):
    with pytest.raises(SetupError, match="activation must be one of"):
        cls(OBS, gym.spaces.Discrete(3), activation="gelu")


def test_gru_skip_heads_read_the_present_observation():
    """With skip=True the action head sees the encoded observation next to the state."""
    torch.manual_seed(0)
    agent = GRUAgent(OBS, gym.spaces.Discrete(3), hidden_size=8, encoder_sizes=[6], skip=True, head_sizes=[5])
    assert agent.actor_mlp[0].in_features == 8 + 6 and agent.head.linear.in_features == 5
    obs = torch.randn(4, *OBS.shape)
    state = agent.initial_state(4)
    first = torch.ones(4, dtype=torch.bool)
    out = OneStep(agent)(obs, state, first)
    # Zeroing the GRU's output weights leaves the skip path: the logits still depend on obs.
    with torch.no_grad():
        agent.actor_mlp[0].weight[:, :8].zero_()
    out2 = OneStep(agent)(obs + 1.0, state, first)
    assert not torch.allclose(out["dist", "logits"], out2["dist", "logits"])


class _Counting(StepwiseAgent):
    """A step-only agent: its step is counted."""

    calls: list = []

    def __init__(self, observation_space, action_space):
        super().__init__(observation_space, action_space)
        self.head = ActionHead(action_space, self.obs_dim)
        self.critic = torch.nn.Linear(self.obs_dim, 1)

    def step(self, observation, state, is_first):
        self.calls.append(tuple(is_first.shape))
        x = self.flatten_observation(observation)
        return TensorDict(dist=self.head(x), value=self.critic(x).squeeze(-1), state=state, batch_size=is_first.shape)


def test_a_stepwise_agent_runs_its_step_once_per_row():
    """StepwiseAgent's forward is the one step loop: a call over (k, N) rows runs step k times on
    (N,) rows, and its outputs are the k steps' stacked, equal to k one-row calls."""
    space, actions = gym.spaces.Box(-1.0, 1.0, (3,)), gym.spaces.Discrete(2)
    k, n = 4, 2
    torch.manual_seed(0)
    agent = _Counting(space, actions)
    agent.calls.clear()
    obs = torch.randn(k, n, 3)
    out = agent(observation=obs, state=agent.initial_state(n), is_first=torch.zeros(k, n, dtype=torch.bool))
    assert agent.calls == [(n,)] * k and out["outputs"].batch_size == (k, n) and out["state"].batch_size == (n,)
    rows = [OneStep(agent)(obs[t], agent.initial_state(n), torch.zeros(n, dtype=torch.bool)) for t in range(k)]
    assert torch.equal(out["outputs", "dist", "logits"], torch.stack([r["dist", "logits"] for r in rows]))


def test_an_agent_written_to_the_old_docs_runs_through_the_stepwise_adapter():
    """A subclass of Agent whose forward takes one step (the docs before the one agent shape) is
    built as a StepwiseAgent, with a DeprecationWarning naming the removal version; its class name,
    parameters and outputs are its own. A one-shape agent is built as it is, without a warning."""
    import warnings

    from custom_agent_module import TinyAgent

    from rl_replay._compat import REMOVED_IN

    space, actions = gym.spaces.Box(-1.0, 1.0, (3,)), gym.spaces.Discrete(2)
    torch.manual_seed(0)
    plain = TinyAgent(space, actions)
    torch.manual_seed(0)
    with pytest.warns(DeprecationWarning, match=f"runs through rl_replay.StepwiseAgent.*{REMOVED_IN}"):
        agent = build_agent("custom_agent_module:TinyAgent", {}, space, actions)
    assert isinstance(agent, StepwiseAgent) and isinstance(agent, TinyAgent) and type(agent).__name__ == "TinyAgent"
    assert list(agent.state_dict()) == list(plain.state_dict())
    obs, first = torch.randn(3, 2, 3), torch.zeros(3, 2, dtype=torch.bool)
    out = agent(observation=obs, state=agent.initial_state(2), is_first=first)
    for t in range(3):  # row t is the old forward on step t
        old = plain(observation=obs[t], state=plain.initial_state(2), is_first=first[t])
        assert torch.equal(out["outputs", "value"][t], old["value"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mlp = build_agent("mlp", {}, space, actions)
    assert type(mlp) is MLPAgent
