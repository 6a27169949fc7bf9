"""Parity of blockwise autograd replay with plain autograd (single process, CPU).

Every test runs the same work twice from the same seed and data: once with plain
autograd (the reference) and once through ``rl_replay.replay`` /
``rl_replay.checkpoint_fsdp_forward``, then compares gradients with
``assert_grads_match`` (float32: rtol 1e-5, atol 1e-6; bfloat16: bf16 precision).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from _policies import GRUPolicy, MLPPolicy, step_loss
from conftest import assert_grads_match
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict, TensorDictBase

import rl_replay
from rl_replay import GradientAccumulator, checkpoint_fsdp_forward, replay

# ------------------------------------------------------------------------------ models


def twin(module: nn.Module) -> nn.Module:
    """A deep copy with identical weights (and a fresh call counter)."""
    other = copy.deepcopy(module)
    if hasattr(other, "calls"):
        other.calls = 0
    return other


def named_grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: p.grad for n, p in module.named_parameters()}


def gru_rollout(policy, obs, h0, acc=None, entry="replay"):
    """Loss of a GRU rollout: every step plus the final state. ``acc=None``: plain autograd."""
    h, loss = h0, 0.0
    for t in range(obs.shape[0]):
        if acc is None:
            logits, value, h = policy(observation=obs[t], h=h)
        elif entry == "replay":
            logits, value, h = replay(policy, acc, TensorDict(observation=obs[t], h=h))
        else:
            logits, value, h = checkpoint_fsdp_forward(policy, acc, observation=obs[t], h=h)
        loss = loss + step_loss(logits, value)
    return loss + h.square().sum()


# ------------------------------------------------------------------- independent blocks
@pytest.mark.parametrize("entry", ["replay", "checkpoint_fsdp_forward", "dict_accumulator"])
def test_mlp_independent_blocks(entry):
    torch.manual_seed(0)
    policy = MLPPolicy()
    ref = twin(policy)
    T, B = 12, 4
    obs = torch.randn(T, B, 6)

    sum(step_loss(*ref(obs[t])) for t in range(T)).backward()

    acc = {} if entry == "dict_accumulator" else GradientAccumulator()
    loss = 0.0
    for t in range(T):
        if entry == "replay":
            out = replay(policy, acc, TensorDict(observation=obs[t], batch_size=[B]))
        else:
            out = checkpoint_fsdp_forward(policy, acc, observation=obs[t])
        loss = loss + step_loss(*out)
    loss.backward()

    assert_grads_match(policy, ref, "mlp")
    assert policy.calls == 2 * T
    if entry == "dict_accumulator":
        # The seed API: afterwards the dict maps exactly each parameter to its gradient.
        params = list(policy.parameters())
        assert len(acc) == len(params)
        for p in params:
            assert acc[p] is p.grad


# ---------------------------------------------------------------------- recurrent state
@pytest.mark.parametrize("entry", ["replay", "checkpoint_fsdp_forward"])
def test_gru_hidden_state_carries_gradient(entry):
    torch.manual_seed(1)
    policy = GRUPolicy()
    ref = twin(policy)
    T, B = 60, 3
    obs = torch.randn(T, B, 5)
    h0 = torch.randn(B, 12)
    h0_ref = h0.clone().requires_grad_()
    h0_rep = h0.clone().requires_grad_()

    gru_rollout(ref, obs, h0_ref).backward()
    acc = GradientAccumulator()
    gru_rollout(policy, obs, h0_rep, acc, entry).backward()

    assert_grads_match(policy, ref, "gru")
    assert_grads_match({"h0": h0_rep.grad}, {"h0": h0_ref.grad}, "gru")
    assert acc.num_blocks == acc.blocks_replayed == T
    assert policy.calls == 2 * T


class GatedState(nn.Module):
    """On ``done`` steps the state is returned unchanged: an output that is an input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, observation, h, done: bool):
        y = self.lin(observation).sum(-1)
        return (y, h) if done else (y, torch.tanh(self.lin(h) + observation))


def test_state_returned_unchanged_by_a_block():
    torch.manual_seed(16)
    policy = GatedState()
    ref = copy.deepcopy(policy)
    obs, h0 = torch.randn(8, 2, 4), torch.randn(2, 4)

    def run(model, acc):
        h = start = h0.clone().requires_grad_()
        loss = 0.0
        for t in range(8):
            kwargs = dict(observation=obs[t], h=h, done=t % 3 == 1)
            y, h = model(**kwargs) if acc is None else checkpoint_fsdp_forward(model, acc, **kwargs)
            loss = loss + y.sum()
        (loss + h.square().sum()).backward()
        return start.grad

    g_ref = run(ref, None)
    g_rep = run(policy, GradientAccumulator())
    assert_grads_match(policy, ref, "gru")
    assert_grads_match({"h0": g_rep}, {"h0": g_ref}, "gru")


# --------------------------------------------------------------------------- dropout
def test_dropout_rng_replay_and_caller_stream():
    torch.manual_seed(2)
    policy = GRUPolicy(dropout=0.4).train()
    ref = twin(policy)
    T, B = 16, 4
    obs = torch.randn(T, B, 5)
    h0 = torch.zeros(B, 12)

    torch.manual_seed(1234)
    gru_rollout(ref, obs, h0).backward()
    after_ref = torch.rand(8)

    torch.manual_seed(1234)
    acc = GradientAccumulator()
    gru_rollout(policy, obs, h0, acc).backward()
    after_replay = torch.rand(8)

    assert_grads_match(policy, ref, "dropout")
    # The recompute ran inside fork_rng: the caller's RNG stream is where plain
    # autograd leaves it.
    assert torch.equal(after_replay, after_ref)
    # Sanity: dropout really is random here (different seeds, different gradients).
    other = twin(ref)
    for p in other.parameters():
        p.grad = None
    torch.manual_seed(999)
    gru_rollout(other, obs, h0).backward()
    assert not torch.allclose(other.enc.weight.grad, ref.enc.weight.grad)


# -------------------------------------------------------------------------- autocast
class LinearRecurrence(nn.Module):
    def __init__(self, obs: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(obs, hidden)
        self.rec = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, 2)
        self.autocast_seen: list[bool] = []

    def forward(self, observation, h):
        self.autocast_seen.append(torch.is_autocast_enabled("cpu"))
        h = torch.tanh(self.inp(observation) + self.rec(h))
        return self.out(h), h


def test_autocast_bf16_cpu():
    torch.manual_seed(3)
    policy = LinearRecurrence()
    ref = copy.deepcopy(policy)
    ref_uncached = copy.deepcopy(policy)
    T, B = 12, 4
    obs = torch.randn(T, B, 8)
    h0 = torch.randn(B, 16)

    def run(model, acc, cache_enabled=True):
        h, loss, dtypes = h0, 0.0, set()
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache_enabled):
            for t in range(T):
                if acc is None:
                    y, h = model(observation=obs[t], h=h)
                else:
                    y, h = replay(model, acc, TensorDict(observation=obs[t], h=h))
                dtypes.add(y.dtype)
                loss = loss + y.float().square().mean()
        loss = loss + h.float().square().mean()
        loss.backward()  # outside autocast, as recommended
        return dtypes

    ref_dtypes = run(ref, None)
    run(ref_uncached, None, cache_enabled=False)
    acc = GradientAccumulator()
    rep_dtypes = run(policy, acc)

    # The block really ran in bf16 ...
    assert ref_dtypes == rep_dtypes == {torch.bfloat16}
    # ... and so did the recompute (during backward, outside the user's autocast).
    assert policy.autocast_seen == [True] * (2 * T)
    # Same autocast as the user's plain-autograd run: equal within bf16 precision.
    # (Plain autograd reuses one cached bf16 copy of each weight for all T steps, so
    # it sums the T weight gradients in bf16; replay casts per block and sums in fp32.)
    assert_grads_match(policy, ref, "autocast_bf16", rtol=1.6e-2, atol=1e-2)
    # With the cast cache off, plain autograd also sums per step in fp32: same numbers.
    assert_grads_match(policy, ref_uncached, "autocast_bf16_uncached")


# ------------------------------------------------------------------- unused outputs
class AuxPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 10)
        self.pi = nn.Linear(10, 3)
        self.v = nn.Linear(10, 1)
        self.aux = nn.Linear(10, 4)
        self.calls = 0

    def forward(self, observation):
        self.calls += 1
        z = torch.tanh(self.body(observation))
        return self.pi(z), self.v(z).squeeze(-1), self.aux(z)


def test_unused_aux_output():
    torch.manual_seed(4)
    policy = AuxPolicy()
    ref = twin(policy)
    T, B = 10, 3
    obs = torch.randn(T, B, 6)
    sum(step_loss(*ref(obs[t])[:2]) for t in range(T)).backward()
    acc = GradientAccumulator()
    outs = [checkpoint_fsdp_forward(policy, acc, observation=obs[t]) for t in range(T)]
    sum(step_loss(logits, value) for logits, value, _aux in outs).backward()

    assert_grads_match(policy, ref, "unused_outputs")
    assert policy.aux.weight.grad is None and ref.aux.weight.grad is None


def test_entirely_unused_blocks_are_not_recomputed():
    torch.manual_seed(5)
    policy = AuxPolicy()
    ref = twin(policy)
    T, B = 10, 3
    obs = torch.randn(T, B, 6)
    used = [t for t in range(T) if t % 3 == 0]
    sum(step_loss(*ref(obs[t])[:2]) for t in used).backward()
    acc = GradientAccumulator()
    outs = [checkpoint_fsdp_forward(policy, acc, observation=obs[t]) for t in range(T)]
    sum(step_loss(*outs[t][:2]) for t in used).backward()

    assert_grads_match(policy, ref, "unused_outputs")
    assert policy.calls == T + len(used)
    assert acc.blocks_replayed == len(used)
    assert acc.num_blocks == T


class SplitPolicy(nn.Module):
    """``logits`` depend on the observation only; the new state on the old state only."""

    def __init__(self) -> None:
        super().__init__()
        self.pi = nn.Linear(4, 3)
        self.rec = nn.Linear(5, 5)
        self.calls = 0

    def forward(self, observation, h):
        self.calls += 1
        return self.pi(observation), torch.tanh(self.rec(h))


def test_block_reached_with_no_gradient_is_not_recomputed():
    """A block linked to the loss only through an input gradient that is None."""
    torch.manual_seed(6)
    policy = SplitPolicy()
    ref = twin(policy)
    obs = torch.randn(2, 3, 4)
    h0 = torch.randn(3, 5, requires_grad=True)

    _, h1 = ref(observation=obs[0], h=h0)
    logits, _ = ref(observation=obs[1], h=h1)
    logits.sum().backward()

    acc = GradientAccumulator()
    _, h1 = checkpoint_fsdp_forward(policy, acc, observation=obs[0], h=h0)
    logits, _ = checkpoint_fsdp_forward(policy, acc, observation=obs[1], h=h1)
    logits.sum().backward()

    assert_grads_match(policy, ref, "unused_outputs")
    # Block 1 is recomputed; block 0 gets (at most) an all-None gradient and is not.
    assert policy.calls == 2 + 1
    assert acc.blocks_replayed == 1
    assert h0.grad is None


# ------------------------------------------------------------------- metadata kwargs
class MetadataPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.seen: list[tuple] = []

    def forward(self, observation, repeat: int, mode: str, shape: tuple, dtype: torch.dtype):
        self.seen.append((repeat, mode, shape, dtype))
        y = self.lin(observation.to(dtype))
        if mode == "square":
            y = y.square()
        return (y * repeat).reshape(shape)


def test_metadata_kwargs_reach_the_model_unchanged():
    torch.manual_seed(7)
    policy = MetadataPolicy()
    ref = copy.deepcopy(policy)
    T, B = 5, 2
    obs = torch.randn(T, B, 4)
    meta = dict(repeat=3, mode="square", shape=(B, 2, 3), dtype=torch.float64)
    policy.double()
    ref.double()

    sum(ref(observation=obs[t], **meta).sum() for t in range(T)).backward()
    acc = GradientAccumulator()
    outs = [checkpoint_fsdp_forward(policy, acc, observation=obs[t], **meta) for t in range(T)]
    assert all(o.shape == (B, 2, 3) and o.dtype == torch.float64 for o in outs)
    sum(o.sum() for o in outs).backward()

    assert_grads_match(policy, ref, "metadata", rtol=1e-7, atol=1e-9)
    expected = (3, "square", (B, 2, 3), torch.float64)
    assert len(policy.seen) == 2 * T
    for seen in policy.seen:
        assert seen == expected
        assert type(seen[0]) is int and type(seen[2]) is tuple and seen[3] is torch.float64


# ------------------------------------------------------------ inputs from outside
def test_block_inputs_produced_outside_the_block():
    torch.manual_seed(8)
    encoder = nn.Sequential(nn.Linear(7, 6), nn.ReLU())
    policy = MLPPolicy()
    enc_ref, ref = copy.deepcopy(encoder), twin(policy)
    T, B = 10, 3
    raw = torch.randn(T, B, 7)

    emb = enc_ref(raw)
    sum(step_loss(*ref(emb[t])) for t in range(T)).backward()

    acc = GradientAccumulator()
    emb = encoder(raw)  # plain autograd, outside any block
    loss = sum(step_loss(*replay(policy, acc, TensorDict(observation=emb[t]))) for t in range(T))
    loss.backward()

    assert_grads_match(policy, ref, "outside_module")
    assert_grads_match(encoder, enc_ref, "outside_module")


# ------------------------------------------------------------- two optimizer updates
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_two_consecutive_updates(opt):
    torch.manual_seed(9)
    policy = GRUPolicy()
    ref = twin(policy)

    def make(m):
        if opt == "sgd":
            return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.Adam(m.parameters(), lr=1e-2)

    opt_rep, opt_ref = make(policy), make(ref)
    T, B = 12, 3
    for _it in range(2):
        obs = torch.randn(T, B, 5)
        h0 = torch.randn(B, 12)
        for model, optimizer, replayed in ((ref, opt_ref, False), (policy, opt_rep, True)):
            optimizer.zero_grad()
            acc = GradientAccumulator() if replayed else None
            gru_rollout(model, obs, h0, acc).backward()
            optimizer.step()
            if replayed:
                assert acc.backward_passes == 1 and acc.num_blocks == T
        # Parameters after each update (compared as named tensors).
        assert_grads_match(
            {n: p.detach() for n, p in policy.named_parameters()},
            {n: p.detach() for n, p in ref.named_parameters()},
            "two_updates",
        )


# ------------------------------------------------------------------ TensorDict API
class LSTMPolicy(nn.Module):
    def __init__(self, obs: int = 5, hidden: int = 8) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(obs, hidden)
        self.pi = nn.Linear(hidden, 3)
        self.calls = 0

    def forward(self, observation, state):
        self.calls += 1
        assert isinstance(state, TensorDictBase)
        h, c = self.cell(observation, (state["h"], state["c"]))
        return TensorDict(
            logits=self.pi(h),
            state=TensorDict(h=h, c=c, batch_size=observation.shape[:1]),
            batch_size=observation.shape[:1],
        )


def test_tensordict_nested_state_and_outputs():
    torch.manual_seed(10)
    policy = LSTMPolicy()
    ref = twin(policy)
    T, B = 20, 3
    obs = torch.randn(T, B, 5)
    h0, c0 = torch.randn(B, 8), torch.randn(B, 8)

    def run(model, acc):
        h = h0.clone().requires_grad_()
        c = c0.clone().requires_grad_()
        state = TensorDict(h=h, c=c, batch_size=[B])
        loss = 0.0
        for t in range(T):
            td = TensorDict(observation=obs[t], state=state, batch_size=[B])
            out = model(**td) if acc is None else replay(model, acc, td)
            assert isinstance(out, TensorDictBase)
            assert isinstance(out["state"], TensorDictBase)
            assert out.batch_size == torch.Size([B])
            state = out["state"]
            loss = loss + out["logits"].logsumexp(-1).sum()
        loss = loss + state["h"].square().sum() + state["c"].square().sum()
        loss.backward()
        return h, c

    h_ref, c_ref = run(ref, None)
    acc = GradientAccumulator()
    h_rep, c_rep = run(policy, acc)

    assert_grads_match(policy, ref, "tensordict")
    assert_grads_match({"h0": h_rep.grad, "c0": c_rep.grad}, {"h0": h_ref.grad, "c0": c_ref.grad}, "tensordict")
    assert acc.num_blocks == acc.blocks_replayed == T


class DictPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, observation):
        y = self.lin(observation)
        return {"logits": y, "value": y.sum(-1), "extra": {"z": y * 2}}


def test_plain_dict_output_is_returned_as_tensordict():
    torch.manual_seed(11)
    policy = DictPolicy()
    ref = copy.deepcopy(policy)
    obs = torch.randn(6, 2, 4)
    loss_ref = 0.0
    for t in range(6):
        out = ref(obs[t])
        loss_ref = loss_ref + out["logits"].square().sum() + out["value"].sum() + out["extra"]["z"].sum()
    loss_ref.backward()

    acc = GradientAccumulator()
    loss = 0.0
    for t in range(6):
        out = replay(policy, acc, TensorDict(observation=obs[t]))
        assert isinstance(out, TensorDictBase)
        assert set(out.keys(include_nested=True, leaves_only=True)) == {"logits", "value", ("extra", "z")}
        loss = loss + out["logits"].square().sum() + out["value"].sum() + out["extra", "z"].sum()
    loss.backward()
    assert_grads_match(policy, ref, "tensordict")


# ------------------------------------------------------------------ counts and counters
def test_each_block_recomputed_exactly_once():
    torch.manual_seed(12)
    policy = GRUPolicy()
    T = 15
    obs = torch.randn(T, 2, 5)
    acc = GradientAccumulator()
    loss = gru_rollout(policy, obs, torch.zeros(2, 12), acc)
    assert policy.calls == T  # forward only, no recompute yet
    loss.backward()
    assert policy.calls == 2 * T
    assert acc.blocks_replayed == T


def test_preexisting_grad_is_added_to():
    torch.manual_seed(14)
    policy = GRUPolicy()
    ref = twin(policy)
    for p, q in zip(policy.parameters(), ref.parameters()):
        g = torch.randn_like(p)
        p.grad, q.grad = g.clone(), g.clone()
    grad_objects = [p.grad for p in policy.parameters()]
    obs = torch.randn(10, 3, 5)
    h0 = torch.randn(3, 12)
    gru_rollout(ref, obs, h0).backward()
    gru_rollout(policy, obs, h0, GradientAccumulator()).backward()
    assert_grads_match(policy, ref, "gru")
    # Plain modules: autograd accumulated in place, no copies of .grad were made.
    assert all(p.grad is g for p, g in zip(policy.parameters(), grad_objects))


def test_retain_graph_second_backward_accumulates():
    torch.manual_seed(15)
    policy = GRUPolicy()
    ref = twin(policy)
    T = 10
    obs = torch.randn(T, 3, 5)
    h0 = torch.randn(3, 12)

    loss_ref = gru_rollout(ref, obs, h0)
    loss_ref.backward(retain_graph=True)
    first_ref = {n: g.clone() for n, g in named_grads(ref).items()}
    loss_ref.backward()

    acc = GradientAccumulator()
    loss = gru_rollout(policy, obs, h0, acc)
    loss.backward(retain_graph=True)
    assert_grads_match(policy, first_ref, "retain_graph")
    loss.backward()
    assert_grads_match(policy, ref, "retain_graph")
    assert acc.backward_passes == 2
    assert acc.blocks_replayed == 2 * T
    assert policy.calls == 3 * T


# ----------------------------------------------------------------- property-based
class TinyRecurrent(nn.Module):
    def __init__(self, obs: int, hidden: int, out: int) -> None:
        super().__init__()
        self.x = nn.Linear(obs, 3 * hidden)
        self.h = nn.Linear(hidden, 3 * hidden)
        self.o = nn.Linear(hidden, out)

    def forward(self, observation, h):  # GRU-like gated recurrence
        xr, xz, xn = self.x(observation).chunk(3, -1)
        hr, hz, hn = self.h(h).chunk(3, -1)
        r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
        n = torch.tanh(xn + r * hn)
        h = (1 - z) * n + z * h
        return self.o(h), h


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    T=st.integers(1, 12),
    B=st.integers(1, 5),
    obs=st.integers(1, 16),
    hidden=st.integers(1, 16),
    out=st.integers(1, 16),
    seed=st.integers(0, 2**16),
    h0_grad=st.booleans(),
)
def test_property_gru_like_parity(T, B, obs, hidden, out, seed, h0_grad):
    torch.manual_seed(seed)
    model = TinyRecurrent(obs, hidden, out)
    ref = copy.deepcopy(model)
    xs = torch.randn(T, B, obs)
    h0 = torch.randn(B, hidden)

    def run(m, acc):
        h = h0.clone().requires_grad_(h0_grad)
        start, loss = h, 0.0
        for t in range(T):
            if acc is None:
                y, h = m(observation=xs[t], h=h)
            else:
                y, h = replay(m, acc, TensorDict(observation=xs[t], h=h))
            loss = loss + y.tanh().sum()
        (loss + h.square().mean()).backward()
        return start.grad

    g_ref = run(ref, None)
    acc = GradientAccumulator()
    g_rep = run(model, acc)
    assert_grads_match(model, ref, "hypothesis")
    if h0_grad:
        assert_grads_match({"h0": g_rep}, {"h0": g_ref}, "hypothesis")
    assert acc.blocks_replayed == T


# -------------------------------------------------------------------------- no_grad
def test_no_grad_just_calls_the_model():
    policy = GRUPolicy()
    obs, h = torch.randn(3, 5), torch.zeros(3, 12)
    acc = GradientAccumulator()
    with torch.no_grad():
        expected = policy(observation=obs, h=h)
        a = replay(policy, acc, TensorDict(observation=obs, h=h))
        b = checkpoint_fsdp_forward(policy, acc, observation=obs, h=h)
        c = checkpoint_fsdp_forward(policy, {}, observation=obs, h=h)
    for out in (a, b, c):
        for x, y in zip(out, expected):
            assert torch.equal(x, y) and x.grad_fn is None and not x.requires_grad
    assert acc.num_blocks == 0 and acc.saved_bytes == 0
    assert policy.calls == 4
    # A mapping output is a TensorDict with or without grad.
    dict_policy = lambda observation: {"x": observation * 2}  # noqa: E731
    with torch.no_grad():
        out = replay(dict_policy, acc, TensorDict(observation=obs))
    assert isinstance(out, TensorDict) and torch.equal(out["x"], obs * 2)
    # The accumulator is still usable for a training rollout.
    logits, value, _ = replay(policy, acc, TensorDict(observation=obs, h=h))
    step_loss(logits, value).backward()
    assert acc.num_blocks == 1 and acc.backward_passes == 1


# ------------------------------------------------------------------------ context_fn
def test_context_fn_enters_forward_and_recompute_contexts():
    from contextlib import contextmanager

    events = []

    @contextmanager
    def tag(name):
        events.append(name + ":enter")
        yield
        events.append(name + ":exit")

    policy = MLPPolicy()
    acc = GradientAccumulator()
    out = replay(policy, acc, TensorDict(observation=torch.randn(2, 6)), context_fn=lambda: (tag("fwd"), tag("rec")))
    assert events == ["fwd:enter", "fwd:exit"]
    step_loss(*out).backward()
    assert events == ["fwd:enter", "fwd:exit", "rec:enter", "rec:exit"]


def test_public_api_is_the_engines_and_listed():
    # Every public engine name is re-exported by the package, listed in both __all__, and the
    # package's name is the engine's object (not a copy that isinstance checks would miss).
    import rl_replay.engine as engine

    assert set(engine.__all__) <= set(rl_replay.__all__)
    for name in engine.__all__:
        assert getattr(rl_replay, name) is getattr(engine, name), name
    assert "Agent" in rl_replay.__all__ and rl_replay.Agent.__module__ == "rl_replay.agent"
