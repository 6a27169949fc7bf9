"""Blocks as sequences: every shipped recurrent agent runs k steps as one call (the one agent
shape, ``Agent.forward`` over ``(k, N)`` rows), and replay blocks use that call.

* a call over k rows equals k one-row calls to float rounding, resets inside the block
  included, for every core with every encoder family and observation kind;
* replay with it gives gradients bit-identical to plain autograd running the same sequence
  calls (recurrence, resets, a truncation that is not a multiple of k, Dict and uint8);
* a block saves what a multi-step block of one-step calls saves: the k steps' inputs and one state;
* a StepwiseAgent is called one step at a time.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from _reference import plain_blocks
from conftest import assert_grads_match
from tensordict import TensorDict

from rl_replay.agent import Policy, StepwiseAgent
from rl_replay.agents.gru import GRUAgent
from rl_replay.agents.gtrxl import WindowTransformerAgent
from rl_replay.agents.lru import LRUAgent
from rl_replay.agents.lstm import LSTMAgent
from rl_replay.agents.mingru import MinGRUAgent
from rl_replay.algorithms.stored import OneStep, replay_sequence
from rl_replay.engine import GradientAccumulator, replay_sequence_call, replay_steps
from rl_replay.spaces import obs_converter

ACT = gym.spaces.Discrete(3)
T, N = 7, 3
CORES = {
    "gru": lambda obs, **kw: GRUAgent(obs, ACT, hidden_size=8, **kw),
    "gru_critic_skip": lambda obs, **kw: GRUAgent(
        obs, ACT, hidden_size=8, separate_critic=True, skip=True, head_sizes=(6,), **kw
    ),
    "lstm": lambda obs, **kw: LSTMAgent(obs, ACT, hidden_size=8, **kw),
    "lru": lambda obs, **kw: LRUAgent(obs, ACT, hidden_size=8, readout_sizes=(8,), **kw),
    "lru_real": lambda obs, **kw: LRUAgent(obs, ACT, hidden_size=8, readout_sizes=(8,), max_phase=0.0, **kw),
    "mingru": lambda obs, **kw: MinGRUAgent(obs, ACT, hidden_size=8, readout_sizes=(8,), **kw),
    # window 2 < T: steps fall out of the window inside a block and across blocks
    "gtrxl": lambda obs, **kw: WindowTransformerAgent(obs, ACT, d_model=8, num_heads=2, window=2, **kw),
    "gtrxl_lru": lambda obs, **kw: WindowTransformerAgent(
        obs, ACT, d_model=8, num_heads=2, window=3, num_layers=1, recurrence="lru", recurrent_size=6, **kw
    ),
}
VECTOR = gym.spaces.Box(-1.0, 1.0, (5,), np.float32)
DICT = gym.spaces.Dict({"cue": gym.spaces.Box(0.0, 1.0, (3,), np.float32), "where": gym.spaces.Discrete(4)})
UINT8 = gym.spaces.Box(0, 255, (6, 6), np.uint8)  # a small uint8 Box: the MLP encoder scales it
GRID = gym.spaces.Dict({"image": gym.spaces.Box(0, 255, (7, 7, 3), np.uint8), "direction": gym.spaces.Discrete(4)})
IMAGE = gym.spaces.Box(0, 255, (12, 12, 3), np.uint8)
#: observation kind -> (space, agent kwargs): the MLP encoder on vectors, Dicts and uint8, the CNNs on images.
OBSERVATIONS = {
    "mlp-box": (VECTOR, {"encoder_sizes": (8,)}),
    "mlp-dict": (DICT, {"encoder_sizes": (8,)}),
    "mlp-uint8": (UINT8, {"encoder_sizes": (8,)}),
    "grid_cnn-dict": (GRID, {"encoder": "grid_cnn", "encoder_sizes": (), "encoder_kwargs": {"image_scale": 0.1}}),
    "impala_cnn-uint8": (
        IMAGE,
        {"encoder": "impala_cnn", "encoder_sizes": (8,), "encoder_kwargs": {"channels": (4, 8)}},
    ),
}


def rows(space: gym.Space, seed: int = 0) -> TensorDict:
    """(T, N) stored rows as the collector converts them; resets inside: env 0 at rows 2 and 5, env 2 at row 3."""
    space.seed(seed)
    samples = [[space.sample() for _ in range(N)] for _ in range(T)]
    if isinstance(space, gym.spaces.Dict):
        obs = torch.stack(
            [obs_converter(space)({k: np.stack([s[k] for s in row]) for k in space.spaces}) for row in samples]
        )
    else:
        obs = torch.stack([obs_converter(space)(np.stack(row)) for row in samples])
    is_first = torch.zeros(T, N, dtype=torch.bool)
    is_first[2, 0] = is_first[5, 0] = is_first[3, 2] = True
    action = torch.randint(0, 3, (T, N), generator=torch.Generator().manual_seed(seed))
    return TensorDict(observation=obs, is_first=is_first, action=action, batch_size=[T, N])


def random_state(agent, n: int = N) -> TensorDict:
    """A random state of ``agent``: normal values, and every window entry valid (the attention
    cores' ``valid`` is 0 / 1)."""
    state = agent.initial_state(n).apply(torch.randn_like)
    for key in [k for k in state.keys() if k.startswith("valid")]:  # "valid", "valid_critic"
        state[key] = torch.ones_like(state[key])
    return state


def build(core: str, kind: str):
    torch.manual_seed(0)
    space, kwargs = OBSERVATIONS[kind]
    return CORES[core](space, **kwargs), space


@pytest.mark.parametrize("kind", sorted(OBSERVATIONS))
@pytest.mark.parametrize("core", sorted(CORES))
def test_a_call_over_k_rows_equals_k_one_row_calls(core, kind):
    agent, space = build(core, kind)
    data = rows(space)
    state = random_state(agent)
    with torch.no_grad():
        whole = agent(observation=data["observation"], state=state, is_first=data["is_first"])
        assert whole.batch_size == torch.Size([]) and whole["outputs"].batch_size == torch.Size([T, N])
        assert set(whole["state"].keys()) == set(state.keys())
        s, steps = state, []
        for t in range(T):
            out = OneStep(agent)(observation=data["observation"][t], state=s, is_first=data["is_first"][t])
            assert out.batch_size == torch.Size([N])
            steps.append(out.exclude("state"))
            s = out["state"]
    loop = torch.stack(steps)
    # float rounding only: the encoder, readout and heads see the T * N rows in one product
    for key, value in loop.items(include_nested=True, leaves_only=True):
        torch.testing.assert_close(whole["outputs"][key], value, rtol=1e-5, atol=1e-5, msg=str(key))
    for key in state.keys():
        torch.testing.assert_close(whole["state"][key], s[key], rtol=1e-5, atol=1e-5)
    # a reset inside the sequence: what came before it does not reach the outputs after it
    other = random_state(agent)
    with torch.no_grad():
        again = agent(observation=data["observation"], state=other, is_first=data["is_first"])
    assert torch.equal(again["outputs", "value"][2:, 0], whole["outputs", "value"][2:, 0])
    assert not torch.equal(again["outputs", "value"][:2, 0], whole["outputs", "value"][:2, 0])


def _gradients(agent, data, start_state, run):
    agent.zero_grad(set_to_none=True)
    start = start_state.clone().apply(lambda x: x.requires_grad_(True))
    out = run(data, start)
    w = torch.linspace(-1.0, 1.0, T * N).view(T, N)
    (w * out["log_prob"] + 0.1 * out["entropy"] + out["value"].square()).sum().backward()
    grads = {n: p.grad.clone() for n, p in agent.named_parameters() if p.grad is not None}
    grads.update({f"start.{k}": v.grad for k, v in start.items()})
    return out.detach(), grads


@pytest.mark.parametrize(
    "core, kind, block_steps, bptt_truncate",
    [
        ("gru", "mlp-box", 3, None),
        ("gru", "mlp-box", T, None),
        ("gru_critic_skip", "mlp-dict", 2, 5),  # truncation not a multiple of k
        ("lstm", "mlp-uint8", 4, None),
        ("lstm", "impala_cnn-uint8", 3, 4),
        ("lru", "grid_cnn-dict", 3, None),
        ("lru_real", "mlp-box", 4, 3),
        ("mingru", "mlp-dict", 3, None),
        ("mingru", "grid_cnn-dict", 5, 2),
        ("gtrxl", "mlp-box", 1, None),  # one-step blocks: each parameter used once per call
        ("gtrxl", "mlp-box", 3, None),
        ("gtrxl", "mlp-dict", 4, 3),
        ("gtrxl", "impala_cnn-uint8", T, None),
        ("gtrxl_lru", "mlp-uint8", 2, None),
        ("gtrxl_lru", "mlp-dict", 1, 4),
        ("gtrxl_lru", "grid_cnn-dict", 3, 5),
    ],
)
def test_replay_of_sequence_blocks_equals_plain_autograd_bit_for_bit(core, kind, block_steps, bptt_truncate):
    agent, space = build(core, kind)
    data = rows(space)
    start_state = random_state(agent)
    acc = GradientAccumulator()
    replayed, got = _gradients(
        agent, data, start_state, lambda d, s: replay_sequence(Policy.of(agent), d, s, acc, bptt_truncate, block_steps)
    )
    spans = -(-T // block_steps) if not bptt_truncate else None
    if spans is not None:
        assert acc.blocks_replayed == spans  # one block, one call, per span
    plain, want = _gradients(
        agent, data, start_state, lambda d, s: plain_blocks(agent, d, s, block_steps, bptt_truncate)
    )
    for key in ("log_prob", "entropy", "value"):
        assert torch.equal(replayed[key], plain[key]), key
    assert any(g.abs().sum() > 0 for k, g in want.items() if k.startswith("start."))
    assert_grads_match(got, want, f"sequence-{core}-{kind}", rtol=0, atol=0)


def test_a_sequence_block_saves_its_steps_inputs_and_one_state():
    agent, space = build("gru", "mlp-uint8")
    data = rows(space)
    state = agent.initial_state(N)
    k = 4
    steps = TensorDict(observation=data["observation"][:k], is_first=data["is_first"][:k], batch_size=[k, N])
    want = sum(t.numel() * t.element_size() for t in (data["observation"][:k], data["is_first"][:k], state["h"]))
    for sequence in (True, False):
        acc = GradientAccumulator()
        if sequence:
            heads, last = replay_sequence_call(agent, acc, steps, state)
        else:
            heads, last = replay_steps(OneStep(agent), acc, steps, state)
        assert heads.batch_size == torch.Size([k, N]) and last.batch_size == torch.Size([N])
        assert acc.saved_bytes == want, (sequence, acc.saved_bytes, want)
        (heads["value"].sum() + last["h"].sum()).backward()
        assert acc.blocks_replayed == 1


class StepOnly(StepwiseAgent):
    """A custom agent with a step and no call over k steps: called one step at a time."""

    def __init__(self, observation_space, action_space):
        super().__init__(observation_space, action_space)
        self.body = torch.nn.Linear(self.obs_dim, 4)
        self.cell = torch.nn.GRUCell(4, 4)
        self.head = torch.nn.Linear(4, 3)
        self.calls: list[tuple] = []

    def initial_state(self, batch_size, device="cpu"):
        return TensorDict(h=torch.zeros(batch_size, 4, device=device), batch_size=[batch_size])

    def step(self, observation, state, is_first):
        self.calls.append(tuple(is_first.shape))
        h = self.cell(
            torch.tanh(self.body(self.flatten_observation(observation))), self.reset_state(state["h"], is_first)
        )
        return TensorDict(
            dist=TensorDict(logits=self.head(h), batch_size=h.shape[:1]),
            value=h.sum(-1),
            state=TensorDict(h=h, batch_size=h.shape[:1]),
            batch_size=h.shape[:1],
        )

    def distribution(self, outputs):
        return torch.distributions.Categorical(logits=outputs["dist", "logits"])


def test_a_stepwise_agent_is_called_step_by_step():
    agent = StepOnly(VECTOR, ACT)
    data = rows(VECTOR)
    acc = GradientAccumulator()
    out = replay_sequence(Policy.of(agent), data, agent.initial_state(N), acc, None, 4)
    agent.calls.clear()
    out["value"].sum().backward()
    assert agent.calls == [(N,)] * T and acc.blocks_replayed == 2  # each block's steps recomputed one by one
    # its forward is the loop of step
    with torch.no_grad():
        whole = agent(observation=data["observation"], state=agent.initial_state(N), is_first=data["is_first"])
    assert whole["outputs"].batch_size == torch.Size([T, N])
    torch.testing.assert_close(whole["outputs", "value"], out["value"].detach(), rtol=0, atol=0)
