"""rl_replay/engine/steps.py: multi-step replay blocks (``replay_steps``).

k steps of a recurrent model as one block must give the gradients of plain autograd bit
for bit (the block's backward runs one nested backward per step, newest first), for any k,
with episode starts inside a block, dropout (RNG replayed per block), autocast, and the
FSDP path (a no-grad pass, then each step recomputed just before its own backward: forced
here on a plain module, run for real under FSDP in tests/engine/test_replay_fsdp.py). A block
saves its k steps' inputs and its starting state only.
"""

from __future__ import annotations

import copy
import gc
import importlib
import weakref

import pytest
import torch
import torch.nn as nn
from conftest import assert_grads_match
from tensordict import TensorDict

from rl_replay import GradientAccumulator, ReplayError, replay_steps

T, B, H = 10, 3, 6


class Cell(nn.Module):
    """A GRU cell with dropout on its input, reset at ``is_first``, TensorDict outputs."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 8)
        self.drop = nn.Dropout(p)
        self.cell = nn.GRUCell(8, H)
        self.head = nn.Linear(H, 3)

    def forward(self, observation, is_first, state):
        h = state["h"] * (~is_first).unsqueeze(-1)
        h = self.cell(self.drop(torch.relu(self.enc(observation))), h)
        return TensorDict(
            dist=TensorDict(logits=self.head(h), batch_size=h.shape[:1]),
            value=h.sum(-1),
            state=TensorDict(h=h, batch_size=h.shape[:1]),
            batch_size=h.shape[:1],
        )


def data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    is_first = torch.zeros(T, B, dtype=torch.bool)
    is_first[4, 0] = is_first[7, 2] = True  # episode starts inside blocks
    return torch.randn(T, B, 4, generator=g), is_first, torch.randn(B, H, generator=g)


def loss_of(logits, value, h):
    w = torch.linspace(-1, 1, logits.numel()).view_as(logits)
    return (w * logits).sum() + value.square().sum() + h.square().sum()


def plain(model, obs, is_first, h0, autocast=False):
    h, logits, values = h0, [], []
    for t in range(T):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(observation=obs[t], is_first=is_first[t], state=TensorDict(h=h, batch_size=[B]))
        h = out["state", "h"]
        logits.append(out["dist", "logits"])
        values.append(out["value"])
    loss_of(torch.stack(logits), torch.stack(values), h).backward()


def blocked(model, acc, obs, is_first, h0, k, autocast=False):
    state, heads = TensorDict(h=h0, batch_size=[B]), []
    for t0 in range(0, T, k):
        t1 = min(T, t0 + k)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            h, state = replay_steps(
                model, acc, TensorDict(observation=obs[t0:t1], is_first=is_first[t0:t1], batch_size=[t1 - t0, B]), state
            )
        heads.append(h)
    heads = torch.cat(heads)
    loss_of(heads["dist", "logits"], heads["value"], state["h"]).backward()


def grads(model, h0):
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    out["h0"] = h0.grad.clone()
    return out


def compare(k, p=0.0, autocast=False, exact=True):
    torch.manual_seed(0)
    model = Cell(p)
    reference = copy.deepcopy(model)
    obs, is_first, h0 = data()
    h_ref, h_rep = h0.clone().requires_grad_(True), h0.clone().requires_grad_(True)
    torch.manual_seed(1)
    plain(reference, obs, is_first, h_ref, autocast)
    torch.manual_seed(1)
    acc = GradientAccumulator()
    blocked(model, acc, obs, is_first, h_rep, k, autocast)
    assert acc.num_blocks == acc.blocks_replayed == -(-T // k)
    want, got = grads(reference, h_ref), grads(model, h_rep)
    assert all(g.abs().sum() > 0 for g in want.values()), "vacuous reference"
    if exact:
        for name in want:
            assert torch.equal(got[name], want[name]), name
    else:
        assert_grads_match(got, want, "steps-fsdp-path")
    return acc


@pytest.mark.parametrize("k", [1, 2, 3, 4, T])
def test_multi_step_blocks_equal_plain_autograd(k):
    compare(k)


@pytest.mark.parametrize("k", [3, T])
def test_dropout_is_replayed_per_block(k):
    compare(k, p=0.3)


def test_autocast_is_replayed():
    compare(4, autocast=True)


@pytest.fixture
def fsdp_path(monkeypatch):
    """The engine's FSDP path on a plain module (gradients absorbed into the accumulator,
    and each step recomputed just before its own backward)."""
    engine = importlib.import_module("rl_replay.engine.plan")
    monkeypatch.setattr(engine, "fsdp_units", lambda module: [module])
    monkeypatch.setattr(engine, "reduces_once", lambda units: False)  # FULL_SHARD's path: absorb per block


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_fsdp_path_equals_plain_autograd(fsdp_path, p):
    # The FSDP path also absorbs each block's gradients into the accumulator's running sum
    # (one-step blocks too): the same sums in another order, so equal to rounding.
    compare(3, p=p, exact=False)


def test_a_block_saves_its_steps_inputs_and_one_state():
    obs, is_first, h0 = data()
    acc = compare(4)
    # Blocks of 4, 4, 2 steps: each keeps its rows of obs and is_first (views of the caller's
    # buffers) and the state it starts from; not the states in between.
    per_step = obs[0].numel() * 4 + is_first[0].numel()
    assert acc.saved_bytes == T * per_step + 3 * h0.numel() * 4


def test_no_graph_outlives_the_backward():
    torch.manual_seed(0)
    model, acc = Cell(), GradientAccumulator()
    obs, is_first, h0 = data()
    heads, state = replay_steps(
        model, acc, TensorDict(observation=obs, is_first=is_first, batch_size=[T, B]), TensorDict(h=h0, batch_size=[B])
    )
    node = weakref.ref(heads["value"].grad_fn)
    loss_of(heads["dist", "logits"], heads["value"], state["h"]).backward()
    del heads, state
    gc.collect()
    assert node() is None and acc.slabs.used_bytes() == {}


def test_without_grad_the_steps_simply_run():
    model = Cell()
    obs, is_first, h0 = data()
    with torch.no_grad():
        heads, state = replay_steps(
            model,
            GradientAccumulator(),
            TensorDict(observation=obs, is_first=is_first, batch_size=[T, B]),
            TensorDict(h=h0, batch_size=[B]),
        )
    assert heads.batch_size == torch.Size([T, B]) and heads["dist", "logits"].shape == (T, B, 3)
    assert state["h"].shape == (B, H)


def test_steps_must_have_a_step_dimension():
    with pytest.raises(ValueError, match="first batch dimension counts the steps"):
        replay_steps(
            Cell(),
            GradientAccumulator(),
            TensorDict(observation=torch.randn(B, 4)),
            TensorDict(h=torch.zeros(B, H), batch_size=[B]),
        )


class NoState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, observation, state):
        return TensorDict(logits=self.lin(observation), batch_size=observation.shape[:1])


def test_each_step_must_return_the_next_state():
    with pytest.raises(TypeError, match=r"with keys \['logits'\]; each step must return a TensorDict with a 'state'"):
        replay_steps(
            NoState(),
            GradientAccumulator(),
            TensorDict(observation=torch.randn(2, B, 4), batch_size=[2, B]),
            TensorDict(h=torch.zeros(B, H), batch_size=[B]),
        )


class Counting(Cell):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, observation, is_first, state):
        self.count += 1
        return super().forward(observation, is_first, state)


def test_a_model_that_changes_its_buffers_is_refused():
    obs, is_first, h0 = data()
    with pytest.raises(ReplayError, match="the forward changed buffer 'count'"):
        replay_steps(
            Counting(),
            GradientAccumulator(),
            TensorDict(observation=obs, is_first=is_first, batch_size=[T, B]),
            TensorDict(h=h0.requires_grad_(True), batch_size=[B]),
        )
