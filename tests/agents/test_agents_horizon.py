"""Long-memory agents: replay-vs-plain parity, chrono initialisation, LRU stability, and the
grad_horizon diagnostic."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from _reference import plain_sequence
from conftest import assert_grads_match
from tensordict import TensorDict

from rl_replay import GradientAccumulator, replay
from rl_replay.agents.chrono import chrono_bias
from rl_replay.agents.gru import GRUAgent
from rl_replay.agents.gtrxl import WindowTransformerAgent
from rl_replay.agents.lru import LRUAgent
from rl_replay.agents.lstm import LSTMAgent
from rl_replay.agents.mingru import MinGRUAgent
from rl_replay.algorithms.stored import OneStep
from rl_replay.errors import SetupError
from rl_replay.rollout.sequence import step_inputs

ROOT = Path(__file__).resolve().parents[2]
OBS = gym.spaces.Box(-1.0, 1.0, shape=(5,), dtype=np.float32)
ACT = gym.spaces.Discrete(3)

# The skeleton's options that change the graph: a second core for the critic, the skip, head MLPs.
SKIP_HEADS = {"separate_critic": True, "skip": True, "head_sizes": (16,), "activation": "relu"}

AGENTS = {
    "gtrxl-skip-heads": lambda: WindowTransformerAgent(
        OBS, ACT, d_model=8, num_heads=2, window=3, encoder_sizes=(8,), **SKIP_HEADS
    ),
    "gtrxl-lru": lambda: WindowTransformerAgent(
        OBS, ACT, d_model=8, num_heads=2, window=2, recurrence="lru", recurrent_size=8, encoder_sizes=(8,)
    ),
    "gru-chrono": lambda: GRUAgent(OBS, ACT, hidden_size=16, encoder_sizes=(16,), chrono_t_max=100),
    "gru-skip-heads": lambda: GRUAgent(OBS, ACT, hidden_size=16, encoder_sizes=(16,), **SKIP_HEADS),
    "lstm-skip-heads": lambda: LSTMAgent(OBS, ACT, hidden_size=16, encoder_sizes=(16,), **SKIP_HEADS),
    "lstm-chrono": lambda: LSTMAgent(OBS, ACT, hidden_size=16, encoder_sizes=(16,), chrono_t_max=100),
    "mingru": lambda: MinGRUAgent(OBS, ACT, hidden_size=16, encoder_sizes=(8,), readout_sizes=(16,)),
    "lru-complex": lambda: LRUAgent(OBS, ACT, hidden_size=16, encoder_sizes=(8,), readout_sizes=(16,)),
    "lru-real": lambda: LRUAgent(
        OBS, ACT, hidden_size=16, encoder_sizes=(8,), readout_sizes=(16,), max_phase=0.0, normalize=False
    ),
    # configs/memory_1024_fast.yaml's layout: no encoder, the recurrence reads the observation.
    "lru-no-encoder": lambda: LRUAgent(
        OBS, ACT, hidden_size=16, encoder_sizes=(), readout_sizes=(16,), r_min=0.99, r_max=0.9999, max_phase=0.0
    ),
    # configs/memory_4096.yaml's layout: every unit slow, small B, no input normalisation.
    "lru-4096": lambda: LRUAgent(
        OBS,
        ACT,
        hidden_size=16,
        encoder_sizes=(),
        readout_sizes=(16,),
        r_min=0.9995,
        r_max=0.99999,
        max_phase=0.0,
        input_scale=0.01,
        normalize=False,
    ),
}


def rollout_loss(agent, observations, is_first, actions, weights, state, block):
    """A per-step policy-gradient-like loss over a rollout; ``block`` runs one step."""
    terms, values = [], []
    for t in range(observations.shape[0]):
        out = block(step_inputs(observations[t], state, is_first[t]))
        dist = agent.distribution(out["outputs"][0])
        terms.append((dist.log_prob(actions[t]) * weights[t]).sum() + 0.1 * dist.entropy().sum())
        values.append(out["outputs", "value"][0])
        state = out["state"]
    # The value of the last step and a function of the final state also carry gradient.
    loss = torch.stack(terms).sum() + torch.stack(values).square().sum()
    return loss + sum(v.square().sum() for v in state.values())


@pytest.mark.parametrize("name", sorted(AGENTS))
def test_replay_equals_plain_autograd_across_an_episode_boundary(name):
    torch.manual_seed(0)
    agent = AGENTS[name]()
    T, N = 12, 3
    observations = torch.randn(T, N, 5)
    is_first = torch.zeros(T, N, dtype=torch.bool)
    is_first[5, 0] = is_first[8, 2] = True  # episodes end inside the rollout
    actions = torch.randint(0, 3, (T, N))
    weights = torch.randn(T, N)
    state0 = agent.initial_state(N).apply(lambda x: torch.randn_like(x))
    # the attention cores' window validity is a 0 / 1 mask, not a value a gradient reaches
    masks = [k for k in state0.keys() if k.startswith("valid")]  # (and "valid_critic")
    for key in masks:
        state0[key] = torch.ones_like(state0[key])

    def grads(block):
        agent.zero_grad(set_to_none=True)
        start = state0.clone()
        for key in start.keys():
            if key not in masks:
                start[key].requires_grad_(True)
        loss = rollout_loss(agent, observations, is_first, actions, weights, start, block)
        loss.backward()
        named = {n: p.grad.clone() for n, p in agent.named_parameters()}
        named.update({f"state0.{k}": v.grad.clone() for k, v in start.items() if k not in masks})
        return loss.detach(), named

    acc = GradientAccumulator()
    replay_loss, replay_grads = grads(lambda inputs: replay(agent, acc, inputs))
    assert acc.blocks_replayed == T
    plain_loss, plain_grads = grads(lambda inputs: agent(**inputs))
    torch.testing.assert_close(replay_loss, plain_loss)
    for key in [k for k in state0.keys() if k not in masks]:
        g = plain_grads[f"state0.{key}"]
        # The reset at is_first cuts the gradient to env 0's and env 2's initial state only
        # for losses after the boundary; the first steps still reach it.
        assert g.abs().sum() > 0
    assert_grads_match(replay_grads, plain_grads, f"parity_horizon_{name}", rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(AGENTS))
def test_state_resets_at_episode_start(name):
    # With is_first set, the output must not depend on the incoming state.
    torch.manual_seed(1)
    agent = AGENTS[name]()
    obs = torch.randn(2, 5)
    first = torch.ones(2, dtype=torch.bool)
    a = OneStep(agent)(observation=obs, state=agent.initial_state(2), is_first=first)
    b = OneStep(agent)(
        observation=obs, state=agent.initial_state(2).apply(lambda x: torch.randn_like(x) * 5), is_first=first
    )
    torch.testing.assert_close(a["dist"]["logits"], b["dist"]["logits"])
    for key in a["state"].keys():
        torch.testing.assert_close(a["state"][key], b["state"][key])


def test_chrono_bias_range_and_gate_layout():
    torch.manual_seed(0)
    b = chrono_bias(10_000, 1000.0)
    assert b.min() >= 0 and b.max() <= math.log(999.0)
    # Memory times 1 + exp(b) spread over [2, T_max]: the median is about T_max / 2.
    times = 1 + b.exp()
    assert 2 <= times.min() and times.max() <= 1000 and 400 < times.median() < 600
    gru = GRUAgent(OBS, ACT, hidden_size=8, chrono_t_max=50)
    assert torch.all(gru.core.bias_hh[8:16] == 0) and torch.all(gru.core.bias_ih[8:16] >= 0)
    lstm = LSTMAgent(OBS, ACT, hidden_size=8, chrono_t_max=50)
    forget, inp = lstm.core.bias_ih[8:16], lstm.core.bias_ih[:8]
    assert torch.equal(inp, -forget) and torch.all(forget >= 0) and forget.max() <= math.log(49)
    assert torch.all(lstm.core.bias_hh[:16] == 0)
    # minGRU writes with z = sigmoid(b): its keep gate 1 - z has memory time 1 / z in [2, T_max].
    mingru = MinGRUAgent(OBS, ACT, hidden_size=64, chrono_t_max=50)
    memory = 1 / torch.sigmoid(mingru.core.gate.bias.detach())
    assert memory.min() >= 2 - 1e-4 and memory.max() <= 50 + 1e-3


@pytest.mark.parametrize("bad", [2, 1.5, -3, "100", True])
def test_bad_chrono_t_max(bad):
    for cls in (GRUAgent, LSTMAgent, MinGRUAgent):
        with pytest.raises(SetupError, match="chrono_t_max must be a number > 2"):
            cls(OBS, ACT, chrono_t_max=bad)


def test_gru_rejects_two_gate_inits():
    with pytest.raises(SetupError, match="update_gate_bias or chrono_t_max, not both"):
        GRUAgent(OBS, ACT, update_gate_bias=5.0, chrono_t_max=100)


def test_lru_ring_init_and_bad_arguments():
    torch.manual_seed(0)
    agent = LRUAgent(OBS, ACT, hidden_size=512, r_min=0.99, r_max=0.999, max_phase=0.3)
    modulus = agent.eigenvalues().abs()
    assert modulus.min() >= 0.99 - 1e-6 and modulus.max() <= 0.999 + 1e-6
    assert agent.eigenvalues().angle().max() <= 0.3 + 1e-6
    # gamma normalises: |lambda|^2 + gamma^2 = 1 at init.
    torch.testing.assert_close(modulus.square() + agent.core.gamma_log.exp().square(), torch.ones(512))
    for kwargs, match in (
        ({"r_min": 0.5, "r_max": 1.0}, "r_min <= r_max < 1"),
        ({"r_min": 0.9, "r_max": 0.8}, "r_min <= r_max < 1"),
        ({"max_phase": 7.0}, "max_phase must be in"),
        ({"hidden_size": 0}, "hidden_size must be a positive integer"),
        ({"input_scale": -1.0}, "input_scale must be a finite number >= 0"),
        ({"input_scale": float("nan")}, "input_scale must be a finite number >= 0"),
    ):
        with pytest.raises(SetupError, match=f"^LRUCore: .*{match}"):  # the core names itself,
            LRUAgent(OBS, ACT, **kwargs)
    with pytest.raises(SetupError, match="^LRUCore: hidden_size"):  # whichever agent holds it
        WindowTransformerAgent(OBS, ACT, d_model=8, num_heads=2, recurrence="lru", recurrent_size=0)


@pytest.mark.parametrize("max_phase", [0.0, 0.3])
def test_lru_without_encoder_a_blank_observation_writes_nothing(max_phase):
    # encoder_sizes=() feeds the observation to B (no bias): a zero observation only decays
    # the state, x_t = lambda * x_{t-1}, so slow units cannot integrate a constant over a long
    # delay (docs/learning.md, fifth study). With a tanh encoder the blank input is
    # tanh(bias), which is 0 only until the biases are trained.
    torch.manual_seed(0)
    agent = LRUAgent(OBS, ACT, hidden_size=8, encoder_sizes=(), r_min=0.9, r_max=0.999, max_phase=max_phase)
    first = torch.zeros(2, dtype=torch.bool)
    state = OneStep(agent)(observation=torch.randn(2, 5), state=agent.initial_state(2), is_first=first)["state"]
    lam = agent.eigenvalues().detach()
    with torch.no_grad():
        x = torch.complex(state["x"], state["x_im"]) if max_phase else state["x"]
        after = OneStep(agent)(observation=torch.zeros(2, 5), state=state, is_first=first)["state"]
        got = torch.complex(after["x"], after["x_im"]) if max_phase else after["x"]
    assert x.abs().min() > 0
    torch.testing.assert_close(got, x * (lam if max_phase else lam.real), rtol=1e-6, atol=1e-7)
    # The same agent with a trained (nonzero) encoder bias would not: the contrast case.
    biased = LRUAgent(OBS, ACT, hidden_size=8, encoder_sizes=(4,), r_min=0.9, r_max=0.999, max_phase=0.0)
    torch.nn.init.constant_(biased.encoder[0].bias, 0.5)
    with torch.no_grad():
        s0 = biased.initial_state(2)
        out = OneStep(biased)(observation=torch.zeros(2, 5), state=s0, is_first=first)["state"]
    assert out["x"].abs().max() > 0


def test_lru_input_scale_scales_the_initial_write():
    torch.manual_seed(0)
    full = LRUAgent(OBS, ACT, hidden_size=8, encoder_sizes=())
    torch.manual_seed(0)
    small = LRUAgent(OBS, ACT, hidden_size=8, encoder_sizes=(), input_scale=0.25)
    torch.testing.assert_close(small.core.B, 0.25 * full.core.B)
    zero = LRUAgent(OBS, ACT, hidden_size=8, encoder_sizes=(), input_scale=0)
    assert not zero.core.B.any()
    # B = 0 writes nothing at first, but B still receives gradient (the write can be learned).
    first = torch.zeros(2, dtype=torch.bool)
    out = OneStep(zero)(observation=torch.randn(2, 5), state=zero.initial_state(2), is_first=first)
    assert not out["state"]["x"].any()
    out["value"].sum().backward()
    assert zero.core.B.grad is not None and zero.core.B.grad.abs().sum() > 0


def test_lru_normalisation_shrinks_a_slow_units_write_by_sqrt_one_minus_lambda_squared():
    # Why configs/memory_4096.yaml turns it off: with |lambda| near 1 the normalised write of the
    # cue (and so the gradient back to it) is sqrt(1 - |lambda|^2) of the plain one, ~0.0045 at
    # 0.99999; the delay itself writes nothing (zero observations, no encoder bias).
    kwargs = dict(hidden_size=8, encoder_sizes=(), r_min=0.9995, r_max=0.99999, max_phase=0.0, input_scale=0.1)
    torch.manual_seed(0)
    normed = LRUAgent(OBS, ACT, normalize=True, **kwargs)
    torch.manual_seed(0)
    plain = LRUAgent(OBS, ACT, normalize=False, **kwargs)
    torch.testing.assert_close(normed.core.B, plain.core.B)
    cue = torch.randn(2, 5)
    first = torch.ones(2, dtype=torch.bool)
    x_normed = OneStep(normed)(observation=cue, state=normed.initial_state(2), is_first=first)["state"]["x"]
    x_plain = OneStep(plain)(observation=cue, state=plain.initial_state(2), is_first=first)["state"]["x"]
    modulus = normed.eigenvalues().abs().detach()
    gamma = torch.sqrt(1 - modulus**2)
    assert float(gamma.max()) < 0.032  # |lambda| >= 0.9995 for every unit
    torch.testing.assert_close(x_normed, x_plain * gamma, rtol=1e-4, atol=1e-7)


def test_lru_gradient_to_a_past_input_is_lambda_to_the_power_of_the_delay():
    # The recurrence is linear and diagonal: d x_t / d x_0 = lambda ** t exactly, so the
    # gradient neither vanishes nor explodes beyond |lambda| ** t, whatever the inputs were.
    torch.manual_seed(0)
    agent = LRUAgent(OBS, ACT, hidden_size=4, r_min=0.999, r_max=0.9999, max_phase=0.0)
    state = agent.initial_state(1).apply(lambda x: x.requires_grad_(True))
    x0 = state["x"]
    first = torch.zeros(1, dtype=torch.bool)
    for _ in range(1000):
        state = OneStep(agent)(observation=torch.randn(1, 5), state=state, is_first=first)["state"]
    state["x"].sum().backward()
    lam = agent.eigenvalues().real.detach().double()
    torch.testing.assert_close(x0.grad[0].double(), lam**1000, rtol=1e-4, atol=0)


def test_grad_horizon_smoke(tmp_path):
    out = tmp_path / "horizon.json"
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "grad_horizon.py"),
        "--delays",
        "2",
        "6",
        "--batch",
        "4",
        "--json",
        str(out),
        "--agent",
        "gru {hidden_size: 8, encoder_sizes: [8], update_gate_bias: 5}",
        "--agent",
        "lru {hidden_size: 8, encoder_sizes: [8], readout_sizes: [8]}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "| GRUAgent(hidden_size=8, encoder_sizes=[8], update_gate_bias=5) |" in proc.stdout
    rows = json.loads(out.read_text())
    assert [(r["agent"], r["delay"]) for r in rows] == [("gru", 2), ("gru", 6), ("lru", 2), ("lru", 6)]
    for r in rows:
        assert r["grad"] > 0 and math.isfinite(r["grad"]) and r["signal"] >= 0
        assert r["blocks_replayed"] == r["delay"] + 2
    # An existing output is never overwritten.
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode != 0 and "exists" in again.stderr


def test_grad_horizon_matches_plain_autograd():
    # The diagnostic's number, through replay blocks, equals the same gradient by plain autograd.
    sys.path.insert(0, str(ROOT / "scripts"))
    import grad_horizon

    target, kwargs = "mingru", {"hidden_size": 8, "encoder_sizes": [8], "readout_sizes": [8], "chrono_t_max": 50}
    row = grad_horizon.measure(target, kwargs, delay=20, batch=4, seed=3)
    observations, _, obs_space, act_space = grad_horizon.episode_observations(20, 4, 3)
    torch.manual_seed(3)
    from rl_replay.agent import build_agent

    agent = build_agent(target, kwargs, obs_space, act_space)
    cue = observations[0].clone().requires_grad_(True)
    T = len(observations)
    is_first = torch.zeros(T, 4, dtype=torch.bool)
    is_first[0] = True
    episode = TensorDict(
        observation=torch.cat([cue.unsqueeze(0), observations[1:]]),
        is_first=is_first,
        action=torch.zeros(T, 4, dtype=torch.long),
        batch_size=[T, 4],
    )
    heads, _ = plain_sequence(agent, episode, agent.initial_state(4))
    heads["log_prob"][-1].sum().backward()
    assert row["grad"] > 0
    assert math.isclose(row["grad"], cue.grad.norm().item(), rel_tol=1e-5)


def test_memory_256_config_runs_an_update(tmp_path):
    # The shipped long-delay config builds its LRU agent and trains (tiny sizes for speed).
    from rl_replay.config import load_config
    from rl_replay.run.setup import build

    cfg = load_config(
        ROOT / "configs" / "memory_256.yaml",
        [
            "env.num_envs=2",
            "env.kwargs.delay=6",
            "collector.num_steps=8",
            "total_env_steps=32",
            "log.wandb_mode=disabled",
            "log.progress=false",
            "checkpoint.every=0",
            f"run_dir={tmp_path / 'run'}",
        ],
    )
    assert cfg.agent.target == "lru" and cfg.collector.bptt_truncate is None
    trainer = build(cfg)
    assert isinstance(trainer.model, LRUAgent)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.step()
    assert metrics["rollout/episodes"] == 2 and 0 <= metrics["rollout/success_rate"] <= 1
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert "core.nu_log" in changed and "core.B" in changed  # the recurrence itself learns


def test_grad_horizon_on_a_trained_run(tmp_path, capsys):
    # --run loads a MemoryCue run's agent with its checkpoint's weights (not an initialisation).
    from rl_replay.config import load_config
    from rl_replay.run.setup import build

    run = tmp_path / "run"
    cfg = load_config(
        ROOT / "configs" / "memory_1024_fast.yaml",
        [
            "env.num_envs=2",
            "env.kwargs.delay=3",
            "collector.num_steps=5",
            "total_env_steps=10",
            "ppo.num_minibatches=1",
            "eval.every=0",
            "log.wandb_mode=disabled",
            "log.progress=false",
            "agent.kwargs={hidden_size: 8, readout_sizes: [8], encoder_sizes: [], max_phase: 0.0}",
            f"run_dir={run}",
        ],
    )
    trainer = build(cfg)
    trainer.train()
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    out = tmp_path / "horizon.json"
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "grad_horizon.py"),
        "--run",
        str(run),
        "--delays",
        "3",
        "7",
        "--batch",
        "4",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"trained: {run} |" in proc.stdout
    rows = json.loads(out.read_text())
    assert [(r["delay"], r["trained"]) for r in rows] == [(3, True), (7, True)]
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import grad_horizon
    finally:
        sys.path.pop(0)
    # The script's numbers are those of the checkpoint's weights, not of a fresh agent.
    trained = grad_horizon.measure(cfg.agent.target, cfg.agent.kwargs, 7, batch=4, weights=weights)
    fresh = grad_horizon.measure(cfg.agent.target, cfg.agent.kwargs, 7, batch=4)
    assert rows[1]["grad"] == trained["grad"] and rows[1]["signal"] == trained["signal"]
    assert (fresh["grad"], fresh["signal"]) != (trained["grad"], trained["signal"])
    # evaluate.py plays the same checkpoint at another delay (how a 1024 agent is tried at 4096).
    from rl_replay.run.cli import evaluate_main

    lengths = {}
    for extra in ([], ["env.kwargs.delay=7"]):
        assert evaluate_main([str(run), "--episodes", "2", *extra]) == 0
        lengths[tuple(extra)] = json.loads(capsys.readouterr().out.splitlines()[-1])["episode_length"]
    assert lengths == {(): 3 + 2, ("env.kwargs.delay=7",): 7 + 2}
    assert evaluate_main([str(run), "agent.kwargs.hidden_size=4"]) == 2
    out_, err = capsys.readouterr()
    assert out_ == "" and "only env.kwargs.* and env.max_episode_steps" in err
    # A run on another env is refused with a line naming it.
    other = tmp_path / "cartpole"
    build(
        load_config(
            None,
            [
                "total_env_steps=16",
                "env.num_envs=2",
                "collector.num_steps=8",
                "log.wandb_mode=disabled",
                "log.progress=false",
                f"run_dir={other}",
            ],
        )
    ).train()
    proc = subprocess.run(
        [*cmd[:3], str(other), "--delays", "3"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0 and "needs a rl_replay/MemoryCue-v0 run" in proc.stderr
