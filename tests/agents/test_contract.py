"""rl_replay/contract.py: ``check_agent``, the Agent contract checked with one forward.

Every violation is one line, a SetupError starting ``agent <target>:``: a forward that does
not return a TensorDict, lacks ``outputs`` (a one-step forward's flat keys included), ``value``
or ``state``, returns outputs not of batch size ``[1, N]`` for one row, ``value`` not of shape
``(1, N)`` or a ``state`` not of batch size ``[N]``, a ``distribution()`` that needs a key the
forward did not return, logits wider or narrower than the action space, samples that do
not fit it, a ``log_prob`` not of shape ``(1, N)``, and a forward that changes a buffer or a
parameter. A conforming agent passes for each action-space kind, and the check leaves the
RNG streams as they were. (Through ``build()``, before a run directory exists:
tests/agents/test_contract_errors.py.)
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torch import nn

from rl_replay.agent import ActionHead, Agent
from rl_replay.contract import check_agent
from rl_replay.errors import SetupError
from rl_replay.rollout.sequence import step_inputs

OBS = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
N = 3
TARGET = "my_pkg.agents:Probe"


class Probe(Agent):
    """A conforming actor-critic; ``edit`` changes its outputs, ``dist_fn`` its distribution,
    ``mutate`` ('buffer' / 'parameter') what its forward changes, ``noisy`` draws random numbers."""

    def __init__(self, action_space, edit=None, dist_fn=None, mutate=None, noisy=False, norm=False):
        super().__init__(OBS, action_space)
        self.body = nn.Sequential(nn.Linear(self.obs_dim, 8), nn.BatchNorm1d(8).eval() if norm else nn.Identity())
        self.head = ActionHead(action_space, 8)
        self.critic = nn.Linear(8, 1)
        self.register_buffer("steps", torch.zeros(()))
        self.edit, self.dist_fn, self.mutate, self.noisy = edit, dist_fn, mutate, noisy

    def forward(self, observation, state, is_first):
        x = torch.tanh(self.body(self.flatten_observation(observation).flatten(0, 1))).unflatten(0, is_first.shape)
        if self.noisy:
            x = x + 0.01 * torch.randn_like(x)
        if self.mutate == "buffer":
            self.steps += 1
        elif self.mutate == "parameter":
            with torch.no_grad():
                self.critic.bias.add_(1.0)
        out = self.output(dist=self.head(x), value=self.critic(x).squeeze(-1), state=state)
        return out if self.edit is None else self.edit(out)

    def distribution(self, outputs):
        return super().distribution(outputs) if self.dist_fn is None else self.dist_fn(outputs)


def inputs_for(agent):
    """The first block's inputs, as the collector's probe_inputs() gives them."""
    return step_inputs(torch.rand(N, 4) * 2 - 1, agent.initial_state(N), torch.ones(N, dtype=torch.bool))


def check(agent, action_space=None, inputs=None):
    inputs = inputs_for(agent) if inputs is None else inputs
    check_agent(agent, agent, inputs, agent.action_space if action_space is None else action_space, TARGET)


def renamed(out):
    outputs = out["outputs"]
    outputs["distribution"] = outputs.pop("dist")
    return out


def set_entry(key, value):
    def edit(out):
        out[key] = value
        return out

    return edit


D2, D3 = gym.spaces.Discrete(2), gym.spaces.Discrete(3)
MD = gym.spaces.MultiDiscrete([2, 3])
BOX2, BOX3 = gym.spaces.Box(-1, 1, (2,), np.float32), gym.spaces.Box(-1, 1, (3,), np.float32)

VIOLATIONS = {  # id: (agent, action space checked against, message after "agent TARGET: ")
    "not_a_tensordict": (
        lambda: Probe(D2, edit=lambda out: (out["outputs", "value"],)),
        None,
        r"forward\(\) must return a TensorDict, got tuple\.",
    ),
    "one_step_forward": (
        lambda: Probe(D2, edit=lambda out: out["outputs"][0].set("state", out["state"])),
        None,
        r"forward\(\) returned keys \['dist', 'state', 'value'\]; expected 'outputs' .* or subclass "
        r"rl_replay.StepwiseAgent for a forward of one step\.$",
    ),
    "no_state": (
        lambda: Probe(D2, edit=lambda out: out.exclude("state")),
        None,
        r"forward\(\) returned keys \['outputs'\]; expected 'outputs'",
    ),
    "outputs_of_one_step": (
        lambda: Probe(D2, edit=lambda out: set_entry("outputs", out["outputs"][0])(out)),
        None,
        r"forward\(\) returned 'outputs' \(3,\) for one row of 3 envs; expected a TensorDict of batch size \[1, 3\]",
    ),
    "no_value": (
        lambda: Probe(D2, edit=lambda out: out.exclude(("outputs", "value"))),
        None,
        r"forward\(\) returned outputs \['dist'\] without 'value' \(expected 'dist' and 'value'\)\.",
    ),
    "column_value": (
        lambda: Probe(D2, edit=lambda out: set_entry(("outputs", "value"), out["outputs", "value"].unsqueeze(-1))(out)),
        None,
        r"forward\(\) returned 'value' of shape \(1, 3, 1\); expected \(1, 3\), one value per row and env",
    ),
    "state_a_tensor": (
        lambda: Probe(D2, edit=set_entry("state", torch.zeros(N))),
        None,
        r"forward\(\) returned 'state' Tensor; expected a TensorDict of batch size \[3\]",
    ),
    "state_batch_nx2": (
        lambda: Probe(D2, edit=set_entry("state", TensorDict(h=torch.zeros(N, 2), batch_size=[N, 2]))),
        None,
        r"forward\(\) returned 'state' \(3, 2\); expected a TensorDict of batch size \[3\]",
    ),
    "dist_renamed": (
        lambda: Probe(D2, edit=renamed),
        None,
        r"distribution\(\) needs key 'dist' but forward\(\) returned outputs \['distribution', 'value'\]\.$",
    ),
    "narrow_logits": (
        lambda: Probe(D2),
        D3,
        r"its action distribution has 2 logits but the action space Discrete\(3\) has 3 actions\.$",
    ),
    "multi_discrete_widths": (
        lambda: Probe(MD),
        gym.spaces.MultiDiscrete([3, 3]),
        r"its action distribution has logits of widths \[2, 3\] but the action space "
        r"MultiDiscrete\(\[3 3\]\) needs \[3, 3\]\.$",
    ),
    "box_actions": (
        lambda: Probe(BOX2),
        BOX3,
        r"sampled actions of shape \(1, 3, 2\) do not fit the action space Box",
    ),
    "rows": (
        lambda: Probe(D2, dist_fn=lambda out: torch.distributions.Categorical(logits=out["dist", "logits"][:, :1])),
        None,
        r"actions sampled from its distribution have shape \(1, 1\); expected one per row and env \(1, 3, \.\.\.\)",
    ),
    "log_prob_per_dim": (
        lambda: Probe(BOX2, dist_fn=lambda out: torch.distributions.Normal(out["dist", "loc"], out["dist", "scale"])),
        None,
        r"its distribution's log_prob has shape \(1, 3, 2\); expected \(1, 3\)\.$",
    ),
    "buffer_changed": (
        lambda: Probe(D2, mutate="buffer"),
        None,
        r"forward\(\) changed its buffer 'steps'; a replay block runs the forward twice, so it must "
        r"not modify parameters or buffers \(put BatchNorm in eval mode or use LayerNorm\)\.$",
    ),
    "parameter_changed": (
        lambda: Probe(D2, mutate="parameter"),
        None,
        r"forward\(\) changed its parameter 'critic\.bias'",
    ),
}


@pytest.mark.parametrize("make, space, message", VIOLATIONS.values(), ids=VIOLATIONS.keys())
def test_each_violation_is_a_one_line_setup_error_naming_the_agent(make, space, message):
    torch.manual_seed(0)
    with pytest.raises(SetupError, match=rf"^agent {TARGET}: {message}") as info:
        check(make(), space)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("space", [D2, MD, BOX2], ids=["discrete", "multi_discrete", "box"])
def test_a_conforming_agent_passes_and_the_rng_streams_are_left_as_they_were(space):
    agent = Probe(space, noisy=True, norm=True)  # BatchNorm in eval mode changes nothing
    inputs = inputs_for(agent)
    before = torch.get_rng_state()
    check(agent, inputs=inputs)
    assert torch.equal(torch.get_rng_state(), before)
    assert agent.steps.item() == 0


# ------------------------------------------------------------------ state structure and reset
class Recurrent(Probe):
    """Probe with a state ``h`` (N, 4); ``reset`` zeroes it at is_first, ``returned`` edits the
    state it returns."""

    def __init__(self, action_space=D2, reset=True, returned=None, dropout=0.0):
        super().__init__(action_space)
        self.cell = nn.GRUCell(4, 4)
        self.drop = nn.Dropout(dropout)
        self.reset, self.returned = reset, returned

    def initial_state(self, batch_size, device="cpu"):
        return TensorDict(h=torch.zeros(batch_size, 4), batch_size=[batch_size])

    def forward(self, observation, state, is_first):  # one row (what check_agent calls)
        h = self.reset_state(state["h"], is_first[0]) if self.reset else state["h"]
        h = self.cell(self.drop(observation[0]), h)
        out = super().forward(observation, state, is_first)
        out["outputs", "value"] = out["outputs", "value"] + h.sum(-1)
        out["state"] = TensorDict(h=h, batch_size=h.shape[:1])
        return out if self.returned is None else self.returned(out)


def with_state(**entries):
    def edit(out):
        out["state"] = TensorDict(entries, batch_size=[N])
        return out

    return edit


STATE_VIOLATIONS = {
    "wider": (
        Recurrent(returned=with_state(h=torch.zeros(N, 8))),
        r"forward\(\) returned state 'h' of shape \(3, 8\) but initial_state\(\) gives \(3, 4\); the next block "
        r"takes the returned state as its input",
    ),
    "extra_key": (
        Recurrent(returned=with_state(h=torch.zeros(N, 4), c=torch.zeros(N, 4))),
        r"forward\(\) returned 'state' with keys \['c', 'h'\] but initial_state\(\) has \['h'\]",
    ),
    "dtype": (
        Recurrent(returned=with_state(h=torch.zeros(N, 4, dtype=torch.float64))),
        r"forward\(\) returned state 'h' of dtype torch.float64 but initial_state\(\) gives torch.float32",
    ),
    "no_reset": (
        Recurrent(reset=False),
        r"with is_first set \(every env starts an episode\), forward\(\)'s outputs \['outputs.value', 'state.h'\] "
        r"depend on the incoming state: reset it before using it, state = Agent.reset_state\(state, "
        r"is_first\)",
    ),
    "dist_object": (
        Probe(
            D2,
            edit=lambda out: set_entry(
                ("outputs", "dist"), torch.distributions.Categorical(logits=out["outputs", "dist", "logits"])
            )(out),
            dist_fn=lambda out: out["dist"],
        ),
        r"forward\(\) returned 'dist' as a torch.distributions Categorical; return its parameters "
        r"instead \(a TensorDict such as self.head\(x\), e.g. TensorDict\(logits=...\)\)",
    ),
}


@pytest.mark.parametrize("agent, message", STATE_VIOLATIONS.values(), ids=STATE_VIOLATIONS.keys())
def test_state_structure_reset_and_dist_object_violations(agent, message):
    with pytest.raises(SetupError, match=rf"^agent {TARGET}: {message}") as info:
        check(agent)
    assert "\n" not in str(info.value)


def test_a_resetting_agent_passes_even_with_dropout_in_training_mode():
    check(Recurrent(dropout=0.5).train())


SHIPPED = {  # short name and kwargs: every shipped agent, recurrent variants included
    "mlp": {},
    "gru": {},
    "gru-separate-critic-skip": {"separate_critic": True, "skip": True, "head_sizes": [8]},
    "gru-chrono": {"chrono_t_max": 64},
    "lstm": {},
    "lstm-separate-critic": {"separate_critic": True},
    "lru": {},
    "lru-real": {"max_phase": 0.0},
    "mingru": {},
    "transformer": {"d_model": 16, "num_layers": 1, "num_heads": 2},
}


@pytest.mark.parametrize("space", [D2, BOX2], ids=["discrete", "box"])
@pytest.mark.parametrize("name", SHIPPED, ids=SHIPPED.keys())
def test_every_shipped_agent_passes(name, space):
    from rl_replay.agent import build_agent

    torch.manual_seed(0)
    agent = build_agent(name.split("-")[0], SHIPPED[name], OBS, space)
    check_agent(agent, agent, inputs_for(agent), space, name)
