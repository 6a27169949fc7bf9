"""``ppo.py --pixels``: one recurrent PPO update on pixels, rl_replay vs plain autograd.

The workload where flat memory is decisive: a CNN + GRU agent (``gru`` with ``encoder:
nature_cnn``, ``encoder_sizes: [512]``, ReLU, hidden 256, 4 actions) on 84x84x3 uint8 frames,
8 envs, 2 minibatches (each the whole T-step sequences of 4 envs), 4 epochs. One stored rollout
of T steps (synthetic: seeded frames, episode starts, actions; log-probs and values from a no-grad
pass), updated two ways, each in a fresh process (``ppo.py``'s methods):

1. ``plain``      CleanRL's recipe: each minibatch's sequence re-run with grad from its stored
                  start state, every step's activations kept until backward;
2. ``rl_replay``  :meth:`rl_replay.algorithms.ppo.PPO.optimize`: every step a replay block that
                  keeps only its inputs (the uint8 frame and the state).

Reported per T: peak memory growth of the update (host RSS, ``VmHWM``; on CUDA the device's
``max_memory_allocated``), rl_replay's block-input bytes of its largest minibatch, and time.
Then rl_replay's memory slope per step against its block-input bytes per step (the claim: within
1.25x, plus a constant), and the T at which plain autograd's update would pass 16 GiB: measured
if a measured T passes it, else extrapolated from its slope (and said so). The gradient of every
minibatch of one epoch is compared between the two methods at T = 8 first.

Usage (the workload of ``ppo.py``, the one PPO benchmark)::

    python -m scripts.bench ppo --pixels --smoke                    # 36x36 frames, narrow CNN, T = 8, 16
    python -m scripts.bench ppo --pixels                            # T = 512, 2048, 8192 (long: see docs)
    python -m scripts.bench ppo --pixels --T 512 2048 --epochs 1    # memory is one minibatch's: 1/4 the time
    python -m scripts.bench ppo --pixels --device cuda              # the same on a GPU
"""

from __future__ import annotations

import time

import gymnasium as gym
import numpy as np
import torch

from scripts.bench.common import MemoryMeter, set_threads
from scripts.bench.ppo_update import bench_config, run_update, stored_rollout
from scripts.bench.report import fmt_bytes

PRELOAD = [
    "torch",
    "tensordict",
    "gymnasium",
    "rl_replay",
    "scripts.bench.common",
    "scripts.bench.ppo_update",
    "scripts.bench.pixels",
]
FULL = dict(frame=(84, 84, 3), channels=None, linear=[512], hidden=256, actions=4, envs=8, epochs=4, minibatches=2)
SMOKE = dict(frame=(36, 36, 3), channels=[4, 8, 8], linear=[16], hidden=16, actions=4, envs=4, epochs=1, minibatches=2)
LIMIT = 16 * 2**30  # the plain-autograd budget asked about


# ============================================================================ setup
def build(spec: dict, T: int):
    """(cfg, agent, optimizer, rollout) for one configuration, all seeded, on ``spec["device"]``."""
    from rl_replay.agent import build_agent

    p = spec["policy"]
    cfg = bench_config(p, T, spec.get("epochs") or p["epochs"], p["minibatches"])
    device = torch.device(spec.get("device", "cpu"))
    obs_space = gym.spaces.Box(0, 255, tuple(p["frame"]), np.uint8)
    encoder_kwargs = {} if p["channels"] is None else {"channels": p["channels"]}
    torch.manual_seed(spec.get("seed", 0))
    agent = build_agent(
        "gru",
        {
            "encoder": "nature_cnn",
            "encoder_sizes": p["linear"],
            "activation": "relu",
            "hidden_size": p["hidden"],
            "encoder_kwargs": encoder_kwargs,
        },
        obs_space,
        gym.spaces.Discrete(p["actions"]),
    ).to(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=cfg.optim.lr, eps=cfg.optim.eps)
    return cfg, agent, optimizer, synthetic_rollout(agent, T, p["envs"], tuple(p["frame"]), device)


def synthetic_rollout(agent, T: int, N: int, frame: tuple[int, ...], device: torch.device):
    """A stored rollout as ``Collector.collect()`` returns it: seeded uint8 frames."""
    g = torch.Generator().manual_seed(1234)
    observation = torch.randint(0, 256, (T, N, *frame), generator=g, dtype=torch.uint8).to(device)
    return stored_rollout(agent, observation, g, device)


# ============================================================================ worker
def worker(spec: dict) -> dict:
    set_threads(spec.get("threads", 1))
    device = torch.device(spec.get("device", "cpu"))
    cfg, agent, optimizer, rollout = build(spec, spec["T"])
    _, _, _, warm = build(spec, 2)
    run_update(spec["method"], cfg, agent, optimizer, warm)  # Adam state, allocator warm-up
    meter = MemoryMeter(device)
    torch.manual_seed(1)  # the same minibatch order for both methods
    meter.start()
    t0 = time.perf_counter()
    metrics = run_update(spec["method"], cfg, agent, optimizer, rollout)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    peak = meter.peak_cuda_growth() if device.type == "cuda" else meter.peak_rss_growth()
    return {"peak_growth": peak, "seconds": seconds, "block_input_bytes": metrics.get("memory/replay_saved_bytes")}


# ============================================================================ report
def slope(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``(bytes per step, constant)`` through ``(T, bytes)`` points."""
    Ts, ys = np.array([p[0] for p in points], float), np.array([p[1] for p in points], float)
    if len(points) == 1:
        return ys[0] / Ts[0], 0.0
    a, b = np.polyfit(Ts, ys, 1)
    return float(a), float(b)


def summarize(results: dict, Ts: list[int], memory: str) -> list[str]:
    """The summary lines: rl_replay's slope against its block inputs, plain's 16 GiB T."""
    lines = []
    rep = [(T, results[(T, "rl_replay")]) for T in Ts if "error" not in results.get((T, "rl_replay"), {"error": 1})]
    plain = [(T, results[(T, "plain")]) for T in Ts if "error" not in results.get((T, "plain"), {"error": 1})]
    for T, r in rep:
        p = dict(plain).get(T)
        if p:
            lines.append(
                f"summary T={T}: {memory} rl_replay/plain {r['peak_growth'] / max(p['peak_growth'], 1):.3f}x, "
                f"time rl_replay/plain {r['seconds'] / p['seconds']:.2f}x"
            )
    if len(rep) >= 2:
        per_step, const = slope([(T, r["peak_growth"]) for T, r in rep])
        inputs = rep[-1][1]["block_input_bytes"] / rep[-1][0]
        ratio = per_step / inputs
        lines.append(
            f"summary rl_replay memory: {fmt_bytes(per_step)} per step + {fmt_bytes(const)}; block inputs "
            f"{fmt_bytes(inputs)} per step; ratio {ratio:.2f} ({'within' if ratio <= 1.25 else 'over'} 1.25x)"
        )
    if plain:
        over = [T for T, p in plain if p["peak_growth"] > LIMIT]
        if over:
            lines.append(f"summary plain autograd passes 16 GiB at T={over[0]} (measured)")
        elif len(plain) >= 2:
            per_step, const = slope([(T, p["peak_growth"]) for T, p in plain])
            T16 = (LIMIT - const) / per_step
            lines.append(
                f"summary plain autograd: {fmt_bytes(per_step)} per step + {fmt_bytes(const)}; it would pass "
                f"16 GiB at T={T16:.0f} (extrapolated from T={plain[0][0]}..{plain[-1][0]}, not measured)"
            )
    return lines
