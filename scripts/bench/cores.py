"""The recurrence of a replayed minibatch: the GRU / LSTM cores' fused multi-step kernel against their step loop.

One PPO-style minibatch of a stored rollout (T steps x N envs, flat 8-dim observations, 4
actions, the shipped ``gru`` / ``lstm`` agent with ``hidden_size``) is replayed as blocks of
``--block-steps`` steps (:func:`rl_replay.algorithms.stored.replay_sequence`) and back-propagated,
once with the cores as shipped (a block of k > 1 steps through ``nn.GRU`` / ``nn.LSTM``'s fused
kernel, split at episode starts) and once through the cores' step loop (``_steps``: the input
projection batched over the k steps, the recurrence one step at a time: what a block ran before). The two are timed alternately in one process, one torch thread,
after a warm-up; the median is printed, with the gradients' largest difference between the two
(float rounding: the fused kernel sums in another order).

Usage::

    python -m scripts.bench cores                          # gru and lstm, T = 1026, N = 16, k = 16
    python -m scripts.bench cores --T 4098 --block-steps 16 64 256 --kinds lstm
    python -m scripts.bench cores --smoke
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import gymnasium as gym
import torch
from tensordict import TensorDict

from rl_replay.agent import Policy
from rl_replay.agents import cores
from rl_replay.agents.gru import GRUAgent
from rl_replay.agents.lstm import LSTMAgent
from rl_replay.algorithms.stored import replay_sequence
from rl_replay.engine import GradientAccumulator
from scripts.bench.common import describe_machine, set_threads

AGENTS = {"gru": GRUAgent, "lstm": LSTMAgent}


@contextlib.contextmanager
def step_loop():
    """The cores' step loop for every k (the fused kernel bypassed)."""
    saved = {C: C.forward for C in (cores.GRUCore, cores.LSTMCore)}
    for C in saved:
        C.forward = C._steps
    try:
        yield
    finally:
        for C, forward in saved.items():
            C.forward = forward


def minibatch(T: int, N: int, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    data = TensorDict(
        observation=torch.randn(T, N, 8, generator=g),
        is_first=torch.rand(T, N, generator=g) < 2.0 / T,  # an episode start or two inside
        action=torch.randint(0, 4, (T, N), generator=g),
        batch_size=[T, N],
    )
    data["is_first"][0] = True
    return data


def update(agent, data: TensorDict, block_steps: int) -> tuple[float, dict[str, torch.Tensor]]:
    agent.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    out = replay_sequence(
        Policy.of(agent), data, agent.initial_state(data.batch_size[1]), GradientAccumulator(), None, block_steps
    )
    (out["log_prob"].sum() + out["value"].square().sum()).backward()
    seconds = time.perf_counter() - t0
    return seconds, {n: p.grad.clone() for n, p in agent.named_parameters()}


def _ms(seconds: list[float]) -> str:
    return f"{statistics.median(seconds) * 1e3:.0f} ms ({min(seconds) * 1e3:.0f}-{max(seconds) * 1e3:.0f})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", nargs="+", default=["gru", "lstm"], choices=sorted(AGENTS))
    parser.add_argument("--T", type=int, default=1026)
    parser.add_argument("--N", type=int, default=16, help="envs in the minibatch")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--block-steps", type=int, nargs="+", default=[16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="T = 40, N = 4, hidden 16, 2 repeats")
    args = parser.parse_args(argv)
    if args.smoke:
        args.T, args.N, args.hidden, args.repeats = 40, 4, 16, 2
    set_threads(1)
    print(describe_machine())
    data = minibatch(args.T, args.N)
    print(
        "| core | T | N | k | fused (median, min-max) | step loop (median, min-max) | step / fused (median, min-max "
        "of the pairs) | largest gradient difference |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind in args.kinds:
        torch.manual_seed(0)
        agent = AGENTS[kind](gym.spaces.Box(-1.0, 1.0, (8,)), gym.spaces.Discrete(4), hidden_size=args.hidden)
        for k in args.block_steps:
            fused, looped = [], []
            update(agent, data, k)  # warm-up
            for _ in range(args.repeats):  # alternately: a drift of the machine hits both
                seconds, g_fused = update(agent, data, k)
                fused.append(seconds)
                with step_loop():
                    seconds, g_step = update(agent, data, k)
                looped.append(seconds)
            diff = max(float((g_fused[n] - g_step[n]).abs().max()) for n in g_fused)
            ratios = [b / a for a, b in zip(fused, looped)]  # pair by pair: a drift of the machine cancels
            print(
                f"| {kind} | {args.T} | {args.N} | {k} | {_ms(fused)} | {_ms(looped)} | "
                f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | {diff:.1e} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
