"""One stored-rollout PPO update, the two ways ``ppo.py`` compares (plain autograd, rl_replay),
shared by its GRU and pixel workloads (``pixels.py``)."""

from __future__ import annotations

import types

import torch
from tensordict import TensorDict

__all__ = ["bench_config", "stored_rollout", "plain_calls", "plain_optimize", "run_update"]


def bench_config(p: dict, T: int, epochs: int, minibatches: int):
    """The PPO settings both benchmarks' synthetic updates use (CleanRL's Atari LSTM recipe)."""
    from rl_replay.config import load_config

    return load_config(
        None,
        [
            "loss.algorithm=ppo",
            f"env.num_envs={p['envs']}",
            f"collector.num_steps={T}",
            f"ppo.epochs={epochs}",
            f"ppo.num_minibatches={minibatches}",
            "loss.entropy_coef=0.01",
            "optim.name=adam",
            "optim.lr=2.5e-4",
            "log.wandb_mode=disabled",
        ],
    )


def stored_rollout(agent, observation: torch.Tensor, g: torch.Generator, device: torch.device | str = "cpu"):
    """The (T, N) rollout of ``agent`` on ``observation`` (on ``device``) under ``no_grad``:
    episodes of ~200 steps, random actions, rewards and start flags from ``g`` (CPU)."""
    from rl_replay.rollout.collector import Rollout

    T, N = observation.shape[:2]
    is_first = (torch.rand(T, N, generator=g) < 1 / 200).to(device)  # episodes of ~200 steps
    is_first[0] = True
    start_state = agent.initial_state(N, device)
    log_prob, value, entropy, action = [], [], [], []
    state = start_state
    with torch.no_grad():
        for t in range(T):
            out = agent(observation=observation[t : t + 1], state=state, is_first=is_first[t : t + 1])
            dist = agent.distribution(out["outputs"][0])
            a = torch.randint(agent.action_space.n, (N,), generator=g).to(device)
            action.append(a)
            log_prob.append(dist.log_prob(a))
            entropy.append(dist.entropy())
            value.append(out["outputs", "value"][0])
            state = out["state"]
    value = torch.stack(value)
    terminated = torch.cat([is_first[1:], torch.zeros_like(is_first[:1])])
    data = TensorDict(
        observation=observation,
        is_first=is_first,
        action=torch.stack(action),
        log_prob=torch.stack(log_prob),
        entropy=torch.stack(entropy),
        value=value,
        reward=torch.randn(T, N, generator=g).to(device),
        terminated=terminated,
        truncated=torch.zeros_like(is_first),
        valid=torch.ones_like(is_first),
        next_value=torch.cat([value[1:], torch.zeros_like(value[:1])]),
        batch_size=[T, N],
    )
    return Rollout(data, start_state, T * N)


def plain_calls(agent, data: TensorDict, start_state: TensorDict, block_steps: int) -> TensorDict:
    """``log_prob``, ``entropy``, ``value`` of ``agent`` over a stored (T, n) minibatch with plain
    autograd, every call's graph kept: the calls the replay path makes (one per block of
    ``block_steps`` rows, one per step for a StepwiseAgent)."""
    from rl_replay.agent import StepwiseAgent
    from rl_replay.algorithms.stored import block_spans

    T, n = data.batch_size
    state, heads = start_state, []
    for start, stop in block_spans(T, 1 if isinstance(agent, StepwiseAgent) else block_steps):
        out = agent(observation=data["observation"][start:stop], state=state, is_first=data["is_first"][start:stop])
        heads.append(out["outputs"])
        state = out["state"]
    stacked = torch.cat(heads)
    dist = agent.distribution(stacked)
    return TensorDict(
        log_prob=dist.log_prob(data["action"]), entropy=dist.entropy(), value=stacked["value"], batch_size=[T, n]
    )


def plain_optimize(cfg, agent, optimizer, rollout, calls=plain_calls) -> dict:
    """The CleanRL LSTM recipe on the stored rollout: each minibatch re-run with a full graph.

    The same minibatches, calls (:func:`plain_calls`) and loss (``PPO.loss``) as the replay path
    (:func:`rl_replay.algorithms.stored.replay_sequence`), so only the replay blocks differ. An agent
    makes one call per ``replay.block_steps`` steps, as the replay path does, so the gradients
    compare bit for bit. ``calls(agent, minibatch, start_state,
    block_steps)`` makes the policy's outputs (another library's policy, ``torchrl.py``).
    """
    from rl_replay.algorithms.common import optimizer_step
    from rl_replay.algorithms.losses import gae_targets
    from rl_replay.algorithms.ppo import PPO

    p = cfg.ppo
    data = rollout.data
    T, N = data.batch_size
    advantages, returns, _ = gae_targets(data, gamma=cfg.loss.gamma, gae_lambda=cfg.loss.gae_lambda)
    per_mb = N // p.num_minibatches
    for _ in range(p.epochs):
        order = torch.randperm(N)
        for k in range(p.num_minibatches):
            envs = order[k * per_mb : (k + 1) * per_mb]
            mb = data[:, envs]
            batch = calls(agent, mb, rollout.start_state[envs], cfg.replay.block_steps).update(
                TensorDict(
                    old_log_prob=mb["log_prob"],
                    old_value=mb["value"],
                    advantage=advantages[:, envs],
                    valid=mb["valid"],
                    **{"return": returns[:, envs]},
                    batch_size=[T, per_mb],
                )
            )
            optimizer_step(PPO.loss(batch, cfg), agent, optimizer, cfg.optim.max_grad_norm)
    return {}


def run_update(method: str, cfg, agent, optimizer, rollout) -> dict:
    if method == "plain":
        return plain_optimize(cfg, agent, optimizer, rollout)
    from rl_replay.algorithms.ppo import PPO

    # optimize() reads only the policy and bptt_truncate from the collector.
    collector = types.SimpleNamespace(policy=agent, bptt_truncate=None)
    metrics, _ = PPO(cfg, collector, agent, optimizer).optimize(rollout)
    return metrics


# ============================================================================ worker
