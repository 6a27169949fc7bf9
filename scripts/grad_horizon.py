"""How far back does an agent's gradient reach? A horizon diagnostic on MemoryCue.

For each agent spec and each delay, run ``batch`` MemoryCue episodes (a cue, ``delay``
distractors, the query) through replay blocks -- the engine the trainer uses -- at
initialisation, and report:

* ``grad``: the norm of d(sum over the batch of log pi(action 0 | query step)) / d(cue
  observation), i.e. how much gradient the one scored decision sends back to the cue;
* ``signal``: |mean (logit 0 - logit 1) at the query over cue-0 episodes - the same over
  cue-1 episodes|, how much of the cue the forward pass still carries to the action at the
  query (0: forgotten). Logit differences, not log-probs: at initialisation the policy is
  near uniform and float32 log-probs near log(1/2) cannot resolve differences below ~6e-8.

A column that falls to 0 (float32 underflow) or grows without bound as the delay grows
marks the horizon past which the agent cannot learn the task by gradient at this init.

Usage::

    python scripts/grad_horizon.py                                  # the built-in candidates
    python scripts/grad_horizon.py --agent 'gru {update_gate_bias: 5}' \\
        --agent 'lru {r_max: 0.9999}' --delays 64 256 1024 4096 --json out.json
    python scripts/grad_horizon.py --run runs/mem1024_s1 --delays 256 1024 4096   # trained weights

``--run RUN_DIR`` (repeatable) measures a MemoryCue run's agent with its checkpoint's weights
instead of an initialisation: how far back the trained agent's gradient reaches, and whether
it still carries the cue at delays it was not trained on.

An agent spec is an ``agent.target`` (a built-in name such as ``gru``, or ``module:Class``)
optionally followed by its kwargs in YAML flow style.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import gymnasium
import numpy as np
import torch
import yaml

import rl_replay.envs  # noqa: E402,F401  (registers rl_replay/MemoryCue-v0)
from rl_replay import GradientAccumulator, replay
from rl_replay.agent import build_agent, load_agent_class
from rl_replay.rollout.sequence import step_inputs

#: The agents the diagnostic reports by default: the existing ones (as measured before)
#: and the long-memory candidates.
DEFAULT_SPECS = (
    "gru {update_gate_bias: 5}",
    "gru {update_gate_bias: 8}",
    "gru {chrono_t_max: 1024}",
    "gru {chrono_t_max: 4096}",
    "lstm {forget_bias: 1}",
    "lstm {forget_bias: 4}",
    "lstm {forget_bias: 7}",
    "lstm {chrono_t_max: 1024}",
    "lstm {chrono_t_max: 4096}",
    "mingru {chrono_t_max: 1024}",
    "mingru {chrono_t_max: 4096}",
    "lru {r_min: 0.9, r_max: 0.999}",
    "lru {r_min: 0.99, r_max: 0.9999}",
    "lru {r_min: 0.99, r_max: 0.9999, max_phase: 0}",
)


def parse_spec(spec: str) -> tuple[str, dict]:
    """``'gru {k: v}'`` -> ``('gru', {'k': v})`` (or ``'module:Class {k: v}'``)."""
    target, _, rest = spec.strip().partition(" ")
    kwargs = yaml.safe_load(rest) if rest.strip() else {}
    if not isinstance(kwargs, dict):
        raise SystemExit(
            f"grad_horizon: the kwargs of agent spec {spec!r} must be a YAML mapping such as '{{hidden_size: 128}}'."
        )
    return target, kwargs


def episode_observations(delay: int, batch: int, seed: int, noise_dims: int = 0):
    """Observations ``(delay + 2, batch, obs_dim)`` of ``batch`` MemoryCue episodes, their cues
    ``(batch,)``, and the env's spaces. Half the episodes get cue 0, half cue 1 (seeded)."""
    env = gymnasium.make("rl_replay/MemoryCue-v0", delay=delay, noise_dims=noise_dims)
    cues = np.arange(batch) % 2
    obs_seq, got = [], []
    seed_i = seed * 100_003
    for b in range(batch):
        while True:  # reseed until this episode shows the cue we want
            obs, _ = env.reset(seed=seed_i)
            seed_i += 1
            if int(np.argmax(obs[:2])) == cues[b]:
                break
        episode = [obs]
        for _ in range(delay + 1):
            obs, _, _, _, _ = env.step(0)
            episode.append(obs)
        obs_seq.append(np.stack(episode))
        got.append(cues[b])
    observations = torch.as_tensor(np.stack(obs_seq, axis=1))  # (T, B, obs_dim)
    return observations, torch.as_tensor(np.array(got)), env.observation_space, env.action_space


def load_run(run_dir: str, trust_config: bool = False) -> tuple[str, dict, dict, int]:
    """``(target, kwargs, weights, noise_dims)`` of a MemoryCue run's agent and checkpoint.

    A config.yaml that this user did not sign may name only rl_replay's agents, unless
    ``trust_config`` (docs/checkpoints.md, "The config trust rule").
    """
    from rl_replay.errors import SetupError, one_line
    from rl_replay.rundir.door import RunDirectory, Trust

    try:
        with RunDirectory.open(run_dir, trust=Trust(config=trust_config)) as run:
            cfg = run.config().cfg  # a foreign config's targets are checked here
            if cfg.env.id != "rl_replay/MemoryCue-v0":
                raise SetupError(
                    f"--run {run_dir} trained on {cfg.env.id!r}; the diagnostic replays MemoryCue episodes, "
                    "so it needs a rl_replay/MemoryCue-v0 run."
                )
            weights = run.weights(run.checkpoint("the gradient-horizon diagnostic"))
    except (SetupError, ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"grad_horizon: {one_line(str(exc))}") from None
    return cfg.agent.target, dict(cfg.agent.kwargs), weights, int(cfg.env.kwargs.get("noise_dims", 0))


def measure(
    target: str,
    kwargs: dict,
    delay: int,
    batch: int = 16,
    seed: int = 0,
    noise_dims: int = 0,
    weights: dict | None = None,
) -> dict:
    """Gradient reaching the cue and cue signal at the query, for one agent and delay
    (at its seeded initialisation, or with ``weights``, a checkpoint's agent state dict)."""
    observations, cues, obs_space, act_space = episode_observations(delay, batch, seed, noise_dims)
    torch.manual_seed(seed)
    agent = build_agent(target, kwargs, obs_space, act_space)
    if weights is not None:
        agent.load_state_dict(weights)
    start = time.perf_counter()
    cue_obs = observations[0].clone().requires_grad_(True)  # (B, obs_dim)
    acc = GradientAccumulator()
    state = agent.initial_state(batch)
    first = torch.ones(batch, dtype=torch.bool)
    for t in range(delay + 2):
        obs = cue_obs if t == 0 else observations[t]
        out = replay(agent, acc, step_inputs(obs, state, first))
        state = out["state"]
        first = torch.zeros(batch, dtype=torch.bool)
    outputs = out["outputs"][0]
    log_prob = agent.distribution(outputs).log_prob(torch.zeros(batch, dtype=torch.long))  # (B,)
    log_prob.sum().backward()
    grad = cue_obs.grad.norm().item()
    logits = outputs["dist", "logits"].detach().double()  # (B, num_cues)
    margin = logits[:, 0] - logits[:, 1]
    signal = (margin[cues == 0].mean() - margin[cues == 1].mean()).abs().item()
    return {
        "agent": target,
        "kwargs": kwargs,
        "delay": delay,
        "batch": batch,
        "seed": seed,
        "noise_dims": noise_dims,
        "grad": grad,
        "signal": signal,
        "blocks_replayed": acc.blocks_replayed,
        "seconds": round(time.perf_counter() - start, 3),
    }


def spec_label(target: str, kwargs: dict) -> str:
    args = ", ".join(f"{k}={v}" for k, v in kwargs.items())
    return f"{load_agent_class(target).__name__}({args})"  # the class, however the target names it


def fmt(x: float) -> str:
    if x == 0:
        return "0"
    if not math.isfinite(x):
        return str(x)
    return f"{x:.1e}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--agent",
        action="append",
        metavar="SPEC",
        help="'module:Class {kwargs}' (repeatable); default: the built-in candidates",
    )
    parser.add_argument(
        "--run",
        action="append",
        metavar="RUN_DIR",
        default=[],
        help="a MemoryCue run directory (repeatable): its agent with the checkpoint's weights",
    )
    parser.add_argument(
        "--trust-config",
        action="store_true",
        help="with --run: let a config.yaml you did not write name an agent outside rl_replay (importing it runs it)",
    )
    parser.add_argument("--delays", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise-dims", type=int, default=0, help="distractor noise channels (default 0)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if args.batch < 2:
        parser.error("--batch must be >= 2 (the signal column compares cue-0 and cue-1 episodes)")
    if any(d < 0 for d in args.delays):
        parser.error("--delays must be >= 0")
    if args.json and os.path.exists(args.json):
        parser.error(f"--json {args.json} exists; pass a new path (results are never overwritten)")
    torch.set_num_threads(args.threads)
    # (label, target, kwargs, weights, noise_dims)
    specs = [
        (spec_label(t, k), t, k, None, args.noise_dims)
        for t, k in (parse_spec(s) for s in (args.agent or ([] if args.run else DEFAULT_SPECS)))
    ]
    for run_dir in args.run:
        target, kwargs, weights, noise_dims = load_run(run_dir, args.trust_config)
        specs.append((f"{spec_label(target, kwargs)} trained: {run_dir}", target, kwargs, weights, noise_dims))

    rows = []
    header = (
        "| agent | "
        + " | ".join(f"grad @{d}" for d in args.delays)
        + " | "
        + " | ".join(f"signal @{d}" for d in args.delays)
        + " |"
    )
    print(header)
    print("|" + "---|" * (1 + 2 * len(args.delays)))
    for label, target, kwargs, weights, noise_dims in specs:
        cells = [
            dict(
                measure(target, kwargs, d, args.batch, args.seed, noise_dims, weights),
                trained=weights is not None,
                label=label,
            )
            for d in args.delays
        ]
        rows += cells
        print(
            f"| {label} | "
            + " | ".join(fmt(c["grad"]) for c in cells)
            + " | "
            + " | ".join(fmt(c["signal"]) for c in cells)
            + " |",
            flush=True,
        )
    if args.json:
        with open(args.json, "x") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
