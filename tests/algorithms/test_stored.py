"""rl_replay.algorithms.stored: a stored (T, n) sequence re-run as replay blocks from a start state,
against the plain-autograd reference (recurrence, bptt_truncate, episode starts inside the
sequence), and the stacked-outputs distribution the collector and the replay share."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from _reference import plain_blocks, plain_sequence
from conftest import assert_grads_match
from tensordict import TensorDict

from rl_replay.agent import ActionHead, Policy
from rl_replay.agents.gru import GRUAgent
from rl_replay.agents.lstm import LSTMAgent
from rl_replay.agents.mlp import MLPAgent
from rl_replay.algorithms.stored import block_spans, replay_sequence
from rl_replay.engine import GradientAccumulator
from rl_replay.rollout.sequence import append_outputs, cat_outputs, truncate

OBS = gym.spaces.Box(-1.0, 1.0, shape=(4,), dtype=np.float32)
ACT = gym.spaces.Discrete(3)
T, N = 12, 3

AGENTS = {
    "gru": lambda: GRUAgent(OBS, ACT, hidden_size=8, encoder_sizes=(8,)),
    "lstm": lambda: LSTMAgent(OBS, ACT, hidden_size=8, encoder_sizes=(8,)),
    "mlp": lambda: MLPAgent(OBS, ACT, hidden_sizes=(8,)),
}


def sequence(seed=0):
    """(T, N) stored rows; episodes start inside the sequence (env 0 at row 5, env 2 at row 8)."""
    g = torch.Generator().manual_seed(seed)
    is_first = torch.zeros(T, N, dtype=torch.bool)
    is_first[5, 0] = is_first[8, 2] = True
    return TensorDict(
        observation=torch.randn(T, N, 4, generator=g),
        is_first=is_first,
        action=torch.randint(0, 3, (T, N), generator=g),
        batch_size=[T, N],
    )


def gradients(agent, data, start_state, run):
    """Outputs and gradients (parameters, observations, start state) of a loss on every head."""
    agent.zero_grad(set_to_none=True)
    data = data.clone()
    data["observation"].requires_grad_(True)
    start = start_state.clone().apply(lambda x: x.requires_grad_(True))
    out = run(data, start)
    w = torch.linspace(-1.0, 1.0, T * N).view(T, N)
    (w * out["log_prob"] + 0.1 * out["entropy"] + out["value"].square()).sum().backward()
    grads = {n: p.grad.clone() for n, p in agent.named_parameters()}
    grads["observation"] = data["observation"].grad
    grads.update({f"start.{k}": v.grad for k, v in start.items()})
    return out.detach(), grads


@pytest.mark.parametrize("name", sorted(AGENTS))
@pytest.mark.parametrize("bptt_truncate", [None, 1, 4])
@pytest.mark.parametrize("block_steps", [1, 3, 5, T])
def test_replay_sequence_equals_plain_autograd(name, bptt_truncate, block_steps):
    # block_steps 5 with cuts every 4 rows: blocks end at the cuts too (rows 0-4, 4-8, 8-12);
    # episodes start inside blocks (rows 5 and 8).
    torch.manual_seed(0)
    agent = AGENTS[name]()
    data = sequence()
    start_state = agent.initial_state(N).apply(lambda x: torch.randn_like(x))
    acc = GradientAccumulator()
    replayed, got = gradients(
        agent, data, start_state, lambda d, s: replay_sequence(Policy.of(agent), d, s, acc, bptt_truncate, block_steps)
    )
    assert acc.blocks_replayed == acc.num_blocks == len(block_spans(T, block_steps, bptt_truncate))
    if block_steps > 1:
        # A block is one call of the agent over its rows (the MLP's batched over k * n rows):
        # the reference is plain autograd on the same calls, and the per-step loop agrees to
        # float rounding.
        per_step, per_step_grads = gradients(
            agent, data, start_state, lambda d, s: plain_sequence(agent, d, s, bptt_truncate)[0]
        )
        assert_grads_match(got, per_step_grads, f"sequence-{name}-blocks-vs-per-step", rtol=1e-4, atol=1e-5)
        for key in ("log_prob", "entropy", "value"):
            torch.testing.assert_close(replayed[key], per_step[key], rtol=1e-5, atol=1e-6)
        reference = lambda d, s: plain_blocks(agent, d, s, block_steps, bptt_truncate)  # noqa: E731
    else:
        reference = lambda d, s: plain_sequence(agent, d, s, bptt_truncate)[0]  # noqa: E731
    plain, want = gradients(agent, data, start_state, reference)
    for key in ("log_prob", "entropy", "value"):
        assert torch.equal(replayed[key], plain[key]), key
    assert all(g.abs().sum() > 0 for k, g in want.items() if not k.startswith("start.")), "vacuous reference"
    if name != "mlp":  # the start state reaches the first rows' outputs (cut or not)
        assert all(g.abs().sum() > 0 for k, g in want.items() if k.startswith("start."))
    # Replay recomputes each step exactly as it ran: bit-identical gradients.
    assert_grads_match(got, want, f"sequence-{name}", rtol=0, atol=0)


def test_stateless_blocks_take_dict_observations():
    # A Dict observation (a TensorDict per row) reaches the MLP as (k, n) rows the same way.
    space = gym.spaces.Dict(
        {"pos": gym.spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32), "flag": gym.spaces.Discrete(3)}
    )
    torch.manual_seed(0)
    agent = MLPAgent(space, ACT, hidden_sizes=(8,))
    g = torch.Generator().manual_seed(1)
    observation = TensorDict(
        pos=torch.randn(T, N, 2, generator=g),
        flag=torch.nn.functional.one_hot(torch.randint(0, 3, (T, N), generator=g), 3).float(),
        batch_size=[T, N],
    )
    data = TensorDict(
        observation=observation,
        is_first=torch.zeros(T, N, dtype=torch.bool),
        action=torch.randint(0, 3, (T, N), generator=g),
        batch_size=[T, N],
    )
    acc = GradientAccumulator()
    got = replay_sequence(Policy.of(agent), data, agent.initial_state(N), acc, None, 5)
    (got["log_prob"].sum() + got["value"].sum()).backward()
    replayed = {n: p.grad.clone() for n, p in agent.named_parameters()}
    agent.zero_grad(set_to_none=True)
    want = plain_blocks(agent, data, agent.initial_state(N), 5)
    (want["log_prob"].sum() + want["value"].sum()).backward()
    assert acc.num_blocks == 3 and torch.equal(got["log_prob"].detach(), want["log_prob"].detach())
    assert all(torch.equal(replayed[n], p.grad) for n, p in agent.named_parameters())


def test_bptt_truncate_cuts_the_gradient_to_earlier_rows():
    torch.manual_seed(0)
    agent = AGENTS["gru"]()
    data = sequence()
    start_state = agent.initial_state(N)
    # Only the last row's log-prob: with cuts every 4 steps, rows before 8 get no gradient.
    for k, first_reached in ((None, 0), (4, 8)):
        obs = data["observation"].clone().requires_grad_(True)
        run = data.clone()
        run["observation"] = obs
        out = replay_sequence(Policy.of(agent), run, start_state, GradientAccumulator(), k)
        out["log_prob"][-1, 1].backward()
        reached = obs.grad[:, 1].abs().sum(-1) > 0
        assert reached[first_reached:].all() and not reached[:first_reached].any()


def test_sequence_blocks_equal_plain_autograd_over_the_same_calls_bit_for_bit():
    # One agent call per 4-step block, with and without replay blocks (what
    # scripts/bench/ppo.py measures as plain autograd).
    torch.manual_seed(0)
    agent = AGENTS["gru"]()
    data = sequence()
    start_state = agent.initial_state(N).apply(lambda x: torch.randn_like(x))
    acc = GradientAccumulator()
    replayed, got = gradients(
        agent, data, start_state, lambda d, s: replay_sequence(Policy.of(agent), d, s, acc, None, 4)
    )
    plain, want = gradients(agent, data, start_state, lambda d, s: plain_blocks(agent, d, s, 4))
    assert (replayed == plain).all()
    assert_grads_match(got, want, "sequence-plain-mode", rtol=0, atol=0)


def test_truncate_detaches_after_every_kth_step():
    state = TensorDict(h=torch.ones(2, 3, requires_grad=True) * 2, batch_size=[2])
    assert [truncate(state, t, 3)["h"].requires_grad for t in range(6)] == [True, True, False, True, True, False]
    assert all(truncate(state, t, None) is state for t in range(6))


@pytest.mark.parametrize(
    "space",
    [gym.spaces.Discrete(5), gym.spaces.MultiDiscrete([3, 4]), gym.spaces.Box(-1, 1, (2,))],
    ids=["discrete", "multidiscrete", "box"],
)
def test_log_prob_and_entropy_on_stacked_outputs_equal_the_per_step_ones(space):
    """The collector and the sequence replay build one distribution over the stacked (T, N)
    outputs; its log-probs, entropies and their gradients equal those of one distribution
    per step, bit for bit."""
    torch.manual_seed(0)
    T, N = 6, 3
    head = ActionHead(space, 5, init_std=1.0)
    feats = [torch.randn(N, 5, requires_grad=True) for _ in range(T)]
    outs = [
        TensorDict(dist=head(f), value=f.sum(-1), state=TensorDict(h=f * 2, batch_size=[N]), batch_size=[N])
        for f in feats
    ]
    with torch.no_grad():
        actions = torch.stack([head.distribution(o["dist"]).sample() for o in outs])
    per_step = [head.distribution(o["dist"]) for o in outs]
    logp_ref = torch.stack([d.log_prob(a) for d, a in zip(per_step, actions)])
    ent_ref = torch.stack([d.entropy() for d in per_step])
    columns: dict = {}
    for o in outs:
        append_outputs(columns, o.exclude("state").unsqueeze(0))  # a one-row call's outputs
    heads = cat_outputs(columns, T, N)
    dist = head.distribution(heads["dist"])
    logp, ent = dist.log_prob(actions), dist.entropy()
    assert torch.equal(logp, logp_ref) and torch.equal(ent, ent_ref)
    assert torch.equal(heads["value"], torch.stack([o["value"] for o in outs]))
    w = torch.randn(T, N)
    ref = torch.autograd.grad((w * (logp_ref + 0.1 * ent_ref)).sum(), feats, retain_graph=True)
    got = torch.autograd.grad((w * (logp + 0.1 * ent)).sum(), feats)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_block_spans_end_at_the_cuts():
    assert block_spans(12, 5) == [(0, 5), (5, 10), (10, 12)]
    assert block_spans(12, 5, 4) == [(0, 4), (4, 8), (8, 12)]
    assert block_spans(10, 3, 4) == [(0, 3), (3, 4), (4, 7), (7, 8), (8, 10)]
    assert block_spans(3, 8) == [(0, 3)]
