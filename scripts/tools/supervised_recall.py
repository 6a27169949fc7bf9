"""Can an agent carry MemoryCue's cue to the query at all? A supervised probe, no RL.

The agent (any ``agent.target`` with its kwargs) reads episodes of ``delay + 2`` steps shaped as
MemoryCue's (4-dim observations: two cue channels one-hot at step 0, zeros, the query flag at the
last step) and is trained by cross-entropy between its action logits at the query and the cue
(batches of ``--batch`` fresh episodes, Adam). It prints the loss and the accuracy every 50 steps.
If it reaches 100 % here but not under RL, the architecture and the replayed gradient are not what is
missing; the RL signal is (docs/learning/memory_cue.md, eleventh study).

Usage::

    python scripts/tools/supervised_recall.py --delay 256 gtrxl \\
        '{d_model: 32, num_layers: 2, num_heads: 2, window: 136, ff_mult: 2, encoder_sizes: [32]}'
    python scripts/tools/supervised_recall.py --delay 256 lru '{hidden_size: 128}' --steps 200
"""

from __future__ import annotations

import argparse
import sys
import time

import gymnasium as gym
import torch
import yaml

from rl_replay.agent import build_agent


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="agent.target, e.g. gtrxl")
    parser.add_argument("kwargs", nargs="?", default="{}", help="agent.kwargs as YAML")
    parser.add_argument("--delay", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    agent = build_agent(
        args.target, yaml.safe_load(args.kwargs) or {}, gym.spaces.Box(-1.0, 1.0, (4,)), gym.spaces.Discrete(2)
    )
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.lr)
    T, B = args.delay + 2, args.batch
    is_first = torch.zeros(T, B, dtype=torch.bool)
    is_first[0] = True
    t0 = time.perf_counter()
    for step in range(args.steps):
        cue = torch.randint(0, 2, (B,))
        obs = torch.zeros(T, B, 4)
        obs[0, torch.arange(B), cue] = 1.0
        obs[-1, :, 2] = 1.0
        logits = agent(observation=obs, state=agent.initial_state(B), is_first=is_first)["outputs", "dist", "logits"]
        loss = torch.nn.functional.cross_entropy(logits[-1], cue)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == args.steps - 1:
            accuracy = (logits[-1].argmax(-1) == cue).float().mean().item()
            print(f"step {step}: loss {loss.item():.3f}, accuracy {accuracy:.2f}, {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
