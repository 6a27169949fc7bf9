"""rl_replay/engine/accumulator.py: one rollout's GradientAccumulator.

Covers its counters (``num_blocks``, ``saved_bytes``, ``blocks_replayed``, ``stats()``), the
refusal to record a block once its backward is done, the seed API's plain ``dict`` (which
holds the accumulator during the rollout and mirrors the final gradients afterwards), and
the finalisation of the absorb path (FSDP's): gradients taken out of ``.grad`` before every
block and added back once, also when a block's recompute fails.
Gradients are compared with plain autograd through ``assert_grads_match``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from _policies import GRUPolicy, MLPPolicy, gru_loss, step_loss
from conftest import assert_grads_match
from tensordict import TensorDict

from rl_replay import GradientAccumulator, ReplayError, checkpoint_fsdp_forward, replay


# ------------------------------------------------------------------------- counters
def test_counters():
    torch.manual_seed(13)
    policy = GRUPolicy()
    T, B = 9, 4
    obs = torch.randn(T, B, 5)
    acc = GradientAccumulator()
    h, loss, expected_bytes = torch.zeros(B, 12), 0.0, 0
    for t in range(T):
        td = TensorDict(observation=obs[t], h=h)
        expected_bytes += obs[t].nbytes + h.nbytes
        logits, value, h = replay(policy, acc, td)
        loss = loss + step_loss(logits, value)
    # One extra block through the kwargs entry (a bound method) with an int64 input.
    index = torch.arange(B) % 3
    extra = checkpoint_fsdp_forward(policy.pick, acc, h=h, index=index)
    expected_bytes += h.nbytes + index.nbytes
    loss = loss + extra.sum()

    assert acc.num_blocks == T + 1
    assert acc.saved_bytes == expected_bytes == (T * (B * 5 + B * 12) + B * 12) * 4 + B * 8
    assert acc.blocks_replayed == 0 and acc.backward_passes == 0 and acc.replay_seconds == 0
    loss.backward()
    assert acc.blocks_replayed == T + 1
    assert acc.replay_seconds > 0
    assert acc.backward_passes == 1
    stats = acc.stats()
    assert stats["blocks"] == T + 1 and stats["saved_bytes"] == expected_bytes
    assert stats["blocks_replayed"] == T + 1 and stats["replay_seconds"] == acc.replay_seconds
    assert "backward_passes=1" in repr(acc)


def test_finalisation_releases_the_slabs_and_keeps_the_counters():
    """Once the backward is done the accumulator's store forgets its chunks (a tensor the
    caller still holds keeps its own chunk alive, and its values); the byte counters
    are totals over the rollout and stay as they were."""
    torch.manual_seed(4)
    policy, acc = GRUPolicy(), GradientAccumulator()
    obs = torch.randn(6, 3, 5)
    h, loss = torch.zeros(3, 12), 0.0
    for t in range(6):
        logits, value, h = replay(policy, acc, TensorDict(observation=obs[t], h=h))
        loss = loss + step_loss(logits, value)
    assert acc.slabs.owns(h) and acc.slab_bytes == acc.slabs.reserved_bytes > 0
    assert acc.stats()["slab_bytes"] == acc.slab_bytes
    saved, slab_bytes, held = acc.saved_bytes, acc.slab_bytes, h.detach().clone()
    loss.backward()
    assert acc.slabs.used_bytes() == {} and not acc.slabs.owns(h)
    assert torch.equal(h, held)
    assert (acc.saved_bytes, acc.slab_bytes) == (saved, slab_bytes)


# --------------------------------------------------- one rollout, then refused
def test_reusing_a_finished_accumulator(policy, x):
    acc = GradientAccumulator()
    checkpoint_fsdp_forward(policy, acc, observation=x).sum().backward()
    with pytest.raises(ReplayError, match=r"already finished a backward pass"):
        checkpoint_fsdp_forward(policy, acc, observation=x)
    with pytest.raises(ReplayError, match=r"already finished a backward pass"):
        replay(policy, acc, TensorDict(observation=x))
    assert acc.num_blocks == 1
    # The dict form: after its backward it maps parameters to gradients; reusing it
    # (or passing any non-empty dict) is refused.
    d: dict = {}
    checkpoint_fsdp_forward(policy, d, observation=x).sum().backward()
    assert set(d) == set(policy.parameters())
    with pytest.raises(ReplayError, match=r"dict is not empty: it already finished a backward pass"):
        checkpoint_fsdp_forward(policy, d, observation=x)
    assert set(d) == set(policy.parameters())


def test_dict_holds_the_accumulator_then_mirrors_every_models_gradients():
    """The seed API's dict: during the rollout its one entry is the rollout's accumulator;
    after the backward it maps exactly the parameters that got a gradient, of every model
    of the rollout, to their ``.grad`` (the same tensors): a parameter the blocks never
    reached and a frozen one are not in it."""
    torch.manual_seed(3)
    gru, critic = GRUPolicy(), nn.Linear(12, 1)
    critic.bias.requires_grad_(False)
    ref_gru, ref_critic = copy.deepcopy(gru), copy.deepcopy(critic)
    h, index = torch.randn(4, 12), torch.arange(4) % 3
    ref_gru.pick(h=h, index=index).sum().add(ref_critic(h).sum()).backward()

    d: dict = {}
    picked = checkpoint_fsdp_forward(gru.pick, d, h=h, index=index)  # reaches gru.head only
    value = checkpoint_fsdp_forward(critic, d, input=h)
    assert len(d) == 1
    (acc,) = d.values()
    assert isinstance(acc, GradientAccumulator) and acc.num_blocks == 2
    (picked.sum() + value.sum()).backward()

    expected = [gru.head.weight, gru.head.bias, critic.weight]
    assert len(d) == len(expected) and all(d[p] is p.grad for p in expected)
    assert gru.enc.weight.grad is None and critic.bias.grad is None
    assert_grads_match(gru, ref_gru, "dict_accumulator")
    assert_grads_match(critic, ref_critic, "dict_accumulator")
    assert acc.backward_passes == 1


# ------------------------------------------- the absorb path (FSDP's) on a plain module
@pytest.fixture
def absorb_path(monkeypatch):
    """Make the engine treat a plain module as FSDP-managed: gradients are absorbed into
    the accumulator's sums before every block and added back once at the end, the path
    FSDP1 (whose CPU offload overwrites .grad between blocks) takes."""
    import importlib

    engine = importlib.import_module("rl_replay.engine.plan")
    monkeypatch.setattr(engine, "fsdp_units", lambda module: [module])
    monkeypatch.setattr(engine, "reduces_once", lambda units: False)  # FULL_SHARD's path: absorb per block


def test_absorb_path_matches_plain_autograd(absorb_path):
    torch.manual_seed(0)
    policy = GRUPolicy()
    reference = copy.deepcopy(policy)
    obs, h0 = torch.randn(20, 4, 5), torch.randn(4, 12)
    for p, q in zip(policy.parameters(), reference.parameters()):  # pre-existing grads
        p.grad = torch.full_like(p, 0.5)
        q.grad = torch.full_like(q, 0.5)
    acc = GradientAccumulator()
    h, loss = h0, 0.0
    for t in range(20):
        logits, value, h = replay(policy, acc, TensorDict(observation=obs[t], h=h))
        loss = loss + step_loss(logits, value)
    (loss + h.square().sum()).backward()
    h, ref_loss = h0, 0.0
    for t in range(20):
        logits, value, h = reference(observation=obs[t], h=h)
        ref_loss = ref_loss + step_loss(logits, value)
    (ref_loss + h.square().sum()).backward()

    assert acc.blocks_replayed == 20 and acc.backward_passes == 1
    assert_grads_match(policy, reference, "absorb_path")


class _FailingPolicy(MLPPolicy):
    """Raises when block ``fail_at`` is recomputed (its forward ran fine)."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_at = None

    def forward(self, observation, index):
        if torch.is_grad_enabled() and index == self.fail_at:
            raise RuntimeError("recompute failed")
        return super().forward(observation)


def test_failed_backward_loses_no_gradient(absorb_path):
    torch.manual_seed(1)
    policy = _FailingPolicy()
    reference = copy.deepcopy(policy)
    obs = torch.randn(4, 3, 6)
    for p, q in zip(policy.parameters(), reference.parameters()):
        p.grad = torch.full_like(p, 0.25)
        q.grad = torch.full_like(q, 0.25)

    acc = GradientAccumulator()
    loss = sum(step_loss(*checkpoint_fsdp_forward(policy, acc, observation=obs[t], index=t)) for t in range(4))
    policy.fail_at = 1  # blocks 3 and 2 are replayed (newest first), then block 1 fails
    with pytest.raises(RuntimeError, match="recompute failed"):
        loss.backward()

    # .grad holds what it held before plus what blocks 3 and 2 produced: nothing lost.
    sum(step_loss(*reference(observation=obs[t], index=t)) for t in (2, 3)).backward()
    assert_grads_match(policy, reference, "absorb_path")
    assert acc.blocks_replayed == 2


def test_absorb_path_finalises_once_per_backward_of_a_retained_graph(absorb_path):
    """Each backward of a retained graph absorbs and adds back its own sum: the second
    leaves twice the first's gradients, as plain autograd does."""
    torch.manual_seed(2)
    policy = GRUPolicy()
    reference = copy.deepcopy(policy)
    obs, h0 = torch.randn(5, 3, 5), torch.randn(3, 12)

    ref_loss = gru_loss(reference, obs, h0)
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()
    acc = GradientAccumulator()
    loss = gru_loss(policy, obs, h0, acc)
    loss.backward(retain_graph=True)
    assert acc.backward_passes == 1
    loss.backward()
    assert acc.backward_passes == 2 and acc.blocks_replayed == 10
    assert_grads_match(policy, reference, "absorb_path")
