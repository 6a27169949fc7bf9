"""The GRU and LSTM cores over a block of k > 1 steps: the fused multi-step kernel (nn.GRU /
nn.LSTM's) on the cell's own parameters, split where an episode starts inside the block, equal
to the cell's step loop within float rounding; one step keeps the step loop."""

from __future__ import annotations

import pytest
import torch

import rl_replay.agents.cores as cores
from rl_replay.agents.cores import GRUCore, LSTMCore, segments


def keep_of(k, n, starts):
    keep = torch.ones(k, n, 1)
    for t, env in starts:
        keep[t, env] = 0.0
    return keep


def test_segments_begin_at_row_0_and_wherever_an_episode_starts_after_it():
    assert segments(keep_of(1, 3, [(0, 1)])) == [(0, 1)]
    assert segments(keep_of(6, 3, [])) == [(0, 6)]
    assert segments(keep_of(6, 3, [(0, 2)])) == [(0, 6)]  # a start at row 0 is the state's reset
    assert segments(keep_of(6, 3, [(2, 0), (2, 1), (4, 2), (5, 0)])) == [(0, 2), (2, 4), (4, 5), (5, 6)]


def step_loop(core, u, state, keep):
    ys = []
    for t in range(u.shape[0]):
        y, state = core(u[t : t + 1], state, keep[t : t + 1])  # one step: the cell's own arithmetic
        ys.append(y)
    return torch.cat(ys), state


@pytest.mark.parametrize("Core", [GRUCore, LSTMCore])
@pytest.mark.parametrize("starts", [[], [(0, 0)], [(3, 1), (3, 2), (6, 0)], [(1, 0), (2, 0), (8, 1)]])
def test_the_fused_block_equals_the_step_loop_with_resets_inside(Core, starts, monkeypatch):
    torch.manual_seed(0)
    core = Core(5, 7)
    k, n = 9, 3
    u = torch.randn(k, n, 5, requires_grad=True)
    state = tuple(torch.randn(n, 7, requires_grad=True) for _ in core.state_keys)
    keep = keep_of(k, n, starts)
    calls = []
    kernel = torch._VF.gru if Core is GRUCore else torch._VF.lstm
    monkeypatch.setattr(cores, "_fused", lambda fn, *a: calls.append(fn) or cores_fused(fn, *a))
    y, last = core(u, state, keep)
    assert calls == [kernel] * len(segments(keep))  # one fused call per segment, none per row
    want_y, want_last = step_loop(core, u, state, keep)
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-6)
    for a, b in zip(last, want_last):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # gradients, to the inputs, the start state and the parameters, within float rounding too
    w = torch.randn_like(y)
    got = torch.autograd.grad((w * y).sum() + sum(s.sum() for s in last), [u, *state, *core.parameters()])
    want = torch.autograd.grad((w * want_y).sum() + sum(s.sum() for s in want_last), [u, *state, *core.parameters()])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # a reset row cuts the gradient to the state before it (what the step loop's keep does)
    if (0, 0) in starts:
        assert got[1][0].abs().sum() == 0


cores_fused = cores._fused


@pytest.mark.parametrize("Core", [GRUCore, LSTMCore])
def test_without_grad_the_fused_block_gives_the_floats_of_the_grad_mode_call(Core):
    """A replay block's forward runs without grad and its recompute with grad: the same floats
    (oneDNN's LSTM inference kernel rounds otherwise), so replay stays bit-identical."""
    torch.manual_seed(1)
    core = Core(16, 32)
    u, keep = torch.randn(12, 4, 16), keep_of(12, 4, [(5, 1)])
    state = tuple(torch.zeros(4, 32) for _ in core.state_keys)
    with torch.no_grad():
        y0, s0 = core(u, state, keep)
    y1, s1 = core(u, state, keep)
    assert torch.equal(y0, y1) and all(torch.equal(a, b) for a, b in zip(s0, s1))
    assert not y0.requires_grad
