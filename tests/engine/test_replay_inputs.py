"""The TensorDict structures a replay block takes and returns.

Plain TensorDicts go through the engine's own flatten / rebuild (interned structure specs);
anything else (named dimensions, a TensorDict subclass) through the generic pytree path.
Every case must give the same gradients as plain autograd, and a recompute that returns a
different shape is an error, not a silent broadcast.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from tensordict import TensorDict

from rl_replay import GradientAccumulator, ReplayError, replay


class Recurrent(nn.Module):
    """Reads a nested input state, returns nested outputs (with a two-level entry)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 6)
        self.rec = nn.Linear(6, 6)
        self.out = nn.Linear(6, 2)

    def forward(self, observation, state, scale):
        h = torch.tanh(self.inp(observation) + self.rec(state["h"]) * scale)
        return TensorDict(
            dist=TensorDict(logits=self.out(h), batch_size=h.shape[:1]),
            value=h.sum(-1),
            state=TensorDict(h=h, inner=TensorDict(c=h * 2, batch_size=h.shape[:1]), batch_size=h.shape[:1]),
            batch_size=h.shape[:1],
        )


def _inputs(obs, state, scale, how: str):
    B = obs.shape[0]
    td = TensorDict(observation=obs, state=TensorDict(h=state, batch_size=[B]), scale=scale, batch_size=[B])
    if how == "named":
        td.refine_names("env")
    return td


@pytest.mark.parametrize("how", ["plain", "named"])
def test_gradients_match_plain_autograd_for_each_input_structure(how):
    torch.manual_seed(0)
    model = Recurrent()
    reference = copy.deepcopy(model)
    T, B = 6, 4
    obs = torch.randn(T, B, 3)
    h0 = torch.randn(B, 6, requires_grad=True)
    h0_ref = h0.detach().clone().requires_grad_(True)
    scale = torch.full((B, 1), 0.5)

    def run(m, h, step):
        total = 0.0
        for t in range(T):
            out = step(m, _inputs(obs[t], h, scale, how))
            total = total + out["dist", "logits"].square().sum() + out["value"].sum() + out["state", "inner", "c"].sum()
            h = out["state", "h"]
        total.backward()

    acc = GradientAccumulator()
    run(model, h0, lambda m, td: replay(m, acc, td))
    run(reference, h0_ref, lambda m, td: m(**td))
    assert acc.num_blocks == T and acc.blocks_replayed == T
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert torch.equal(h0.grad, h0_ref.grad)


def test_outputs_keep_their_structure():
    model = Recurrent()
    acc = GradientAccumulator()
    out = replay(model, acc, _inputs(torch.randn(2, 3), torch.randn(2, 6), torch.ones(2, 1), "plain"))
    assert type(out) is TensorDict and out.batch_size == torch.Size([2])
    assert set(out.keys(include_nested=True, leaves_only=True)) == {
        ("dist", "logits"),
        "value",
        ("state", "h"),
        ("state", "inner", "c"),
    }
    assert out["state", "inner"].batch_size == torch.Size([2])
    assert out["value"].grad_fn is not None


class ShapeByGradMode(nn.Module):
    """Returns one row fewer when grad is enabled (i.e. in the recompute)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, observation):
        y = self.lin(observation)
        return TensorDict(y=y[1:] if torch.is_grad_enabled() else y, batch_size=[])


def test_recompute_with_a_different_shape_is_an_error():
    acc = GradientAccumulator()
    out = replay(ShapeByGradMode(), acc, TensorDict(observation=torch.randn(4, 3)))
    with pytest.raises(ReplayError, match=r"shape \(3, 3\) when recomputed where the forward's had shape \(4, 3\)"):
        out["y"].sum().backward()
