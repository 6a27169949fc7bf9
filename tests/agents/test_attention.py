"""The attention cores (``agents/attention.py``): what a step sees, and where the gradient goes.

The sequence call against the step loop and replay against plain autograd are in
``test_sequence_forward.py`` (the ``gtrxl`` and ``gtrxl_lru`` rows); here:

* the banded mask equals the window semantics written as a loop (resets inside the block, an
  old window partly valid);
* a one-layer core's step t reads exactly steps t - W .. t, an L-layer stack L * W steps back,
  nothing from before an episode start; with a recurrence underneath, further;
* under replay with blocks shorter than the window, the gradient of the last step reaches every
  step the window chain reaches, across blocks (no stop-gradient at a block or window edge);
* a block saves its k steps' inputs and one state (the windows).
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict

from rl_replay.agent import Policy
from rl_replay.agents.attention import WindowAttentionCore, attention_mask
from rl_replay.agents.gtrxl import WindowTransformerAgent
from rl_replay.algorithms.stored import replay_sequence
from rl_replay.engine import GradientAccumulator, replay_sequence_call
from rl_replay.errors import SetupError

OBS = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
ACT = gym.spaces.Discrete(3)


def reference_mask(valid: torch.Tensor, keep: torch.Tensor, W: int):
    """The window as the one-step calls keep it, step by step: the keys each step sees."""
    k, n = keep.shape
    allowed = torch.zeros(n, k, W + k, dtype=torch.bool)
    window = [[(j, bool(valid[e, j])) for j in range(W)] for e in range(n)]  # (key index, valid) oldest first
    for t in range(k):
        for e in range(n):
            if keep[t, e] == 0:
                window[e] = [(j, False) for j, _ in window[e]]
            for j, ok in window[e]:
                allowed[e, t, j] = ok
            allowed[e, t, W + t] = True
            window[e] = window[e][1:] + [(W + t, True)]
    next_valid = torch.tensor([[ok for _, ok in window[e]] for e in range(n)])
    return allowed, next_valid


@pytest.mark.parametrize("seed", range(6))
def test_the_banded_mask_is_the_window_of_the_step_loop(seed):
    g = torch.Generator().manual_seed(seed)
    W, k, n = 3, 7, 4
    valid = torch.rand(n, W, generator=g) < 0.6
    keep = (torch.rand(k, n, generator=g) > 0.25).float()
    allowed, next_valid = attention_mask(valid.float(), keep, W)
    want_allowed, want_next = reference_mask(valid, keep, W)
    assert torch.equal(allowed, want_allowed)
    assert torch.equal(next_valid, want_next)


def _agent(**kw):
    torch.manual_seed(0)
    return WindowTransformerAgent(OBS, ACT, **{"d_model": 8, "num_heads": 2, "encoder_sizes": (8,), **kw})


def _reach(agent, T: int, is_first: torch.Tensor | None = None) -> torch.Tensor:
    """Which steps' observations the last step's value depends on (one sequence call)."""
    obs = torch.randn(T, 1, 4, requires_grad=True)
    first = torch.zeros(T, 1, dtype=torch.bool) if is_first is None else is_first
    first[0] = True
    out = agent(observation=obs, state=agent.initial_state(1), is_first=first)
    out["outputs", "value"][-1].sum().backward()
    return obs.grad.abs().sum((1, 2)) > 0


def test_a_step_reads_the_window_of_each_layer_and_nothing_before_an_episode_start():
    T = 12
    reach = _reach(_agent(num_layers=1, window=3), T)
    assert reach.tolist() == [False] * (T - 4) + [True] * 4  # itself and the 3 steps before
    reach = _reach(_agent(num_layers=2, window=3), T)
    assert reach.tolist() == [False] * (T - 7) + [True] * 7  # two windows: 6 steps back
    first = torch.zeros(T, 1, dtype=torch.bool)
    first[9] = True
    reach = _reach(_agent(num_layers=2, window=3), T, first)
    assert reach.tolist() == [False] * 9 + [True] * 3  # the episode started at step 9
    # a recurrence under the attention carries the whole episode
    assert _reach(_agent(num_layers=1, window=2, recurrence="lru", recurrent_size=6), T).all()
    assert _reach(_agent(num_layers=1, window=2, recurrence="gru", recurrent_size=6), T).all()


def test_under_replay_the_gradient_crosses_blocks_through_the_windows():
    T, k = 12, 2  # blocks of 2 steps, windows of 3: every dependency beyond a step crosses a block
    agent = _agent(num_layers=2, window=3)
    obs = torch.randn(T, 1, 4)
    data = TensorDict(
        observation=obs.clone().requires_grad_(True),
        is_first=torch.zeros(T, 1, dtype=torch.bool),
        action=torch.zeros(T, 1, dtype=torch.long),
        batch_size=[T, 1],
    )
    data["is_first"][0] = True
    acc = GradientAccumulator()
    out = replay_sequence(Policy.of(agent), data, agent.initial_state(1), acc, None, k)
    out["value"][-1].sum().backward()
    assert acc.blocks_replayed == T // k
    reach = data["observation"].grad.abs().sum((1, 2)) > 0
    assert reach.tolist() == [False] * (T - 7) + [True] * 7
    # the same dependencies as one plain sequence call
    assert torch.equal(reach, _reach(agent, T))


def test_a_block_saves_its_steps_inputs_and_one_state():
    agent = _agent(num_layers=2, window=5)
    n, k = 3, 4
    state = agent.initial_state(n)
    assert state["memory"].shape == (n, 2, 5, 8) and state["valid"].shape == (n, 5)
    steps = TensorDict(
        observation=torch.randn(k, n, 4), is_first=torch.zeros(k, n, dtype=torch.bool), batch_size=[k, n]
    )
    acc = GradientAccumulator()
    heads, last = replay_sequence_call(agent, acc, steps, state)
    want = sum(t.numel() * t.element_size() for t in (*steps.values(), state["memory"], state["valid"]))
    assert acc.saved_bytes == want
    (heads["value"].sum() + last["memory"].sum()).backward()
    assert acc.blocks_replayed == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_heads": 3}, "num_heads (3) must divide d_model (8)"),
        ({"window": 0}, "window must be a positive integer"),
        ({"gate_bias": float("nan")}, "gate_bias must be a finite number"),
        ({"recurrence": "rnn"}, "recurrence must be one of ['gru', 'lru']"),
    ],
)
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(SetupError, match="WindowTransformerAgent") as err:
        _agent(**kwargs)
    assert message in str(err.value)


def test_the_core_alone_projects_its_input_and_keeps_the_window_width():
    core = WindowAttentionCore(5, d_model=8, num_heads=2, window=4, num_layers=3)
    assert core.state_shape("memory") == (3, 4, 8) and core.state_shape("valid") == (4,)
    u = torch.randn(6, 2, 5)
    state = (torch.zeros(2, 3, 4, 8), torch.zeros(2, 4))
    y, (memory, valid) = core(u, state, torch.ones(6, 2, 1))
    assert y.shape == (6, 2, 8) and memory.shape == (2, 3, 4, 8) and valid.tolist() == [[1.0] * 4] * 2


def test_window_entries_of_an_ended_episode_are_cleared():
    """After a start at the block's last step, only that step is in the window (the rest zero),
    as the one-step calls leave it: an ended episode's inputs do not linger in the state."""
    core = WindowAttentionCore(8, d_model=8, num_heads=2, window=3, num_layers=2)
    state = (torch.randn(1, 2, 3, 8), torch.ones(1, 3))
    keep = torch.ones(4, 1, 1)
    keep[3] = 0
    _, (memory, valid) = core(torch.randn(4, 1, 8), state, keep)
    assert valid.tolist() == [[0.0, 0.0, 1.0]]
    assert torch.count_nonzero(memory[:, :, :2]) == 0 and torch.count_nonzero(memory[:, :, 2]) > 0
