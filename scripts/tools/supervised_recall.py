"""Can an agent carry a recall task's answer to where it is asked at all? A supervised probe, no RL.

``--task memory_cue`` (default): the agent (any ``agent.target`` with its kwargs) reads episodes of
``delay + 2`` steps shaped as MemoryCue's (4-dim observations: two cue channels one-hot at step 0,
zeros, the query flag at the last step) and is trained by cross-entropy between its action logits at
the query and the cue.

``--task repeat_previous``: episodes shaped as POPGym's RepeatPrevious (``--decks`` shuffled decks,
one card's suit per step, ``52 * decks - 1`` steps) as the table's wrappers present them (a Dict of
the suit, a random previous action and the is-first flag, each one-hot); every step from the
``k``-th on is labelled with the suit seen ``k - 1`` steps before it (the env's reward rule).
``--task repeat_first``: the same episodes, every step labelled with the first suit (RepeatFirst's
rule; Hard is ``--decks 16``).

Batches of ``--batch`` fresh episodes, Adam; the loss and the accuracy every ``--every`` steps. If an
agent reaches 100 % here but not under RL, the architecture and the replayed gradient are not what
is missing; the RL signal is (docs/learning/memory_cue.md, eleventh study; docs/learning/popgym.md).

Usage::

    python scripts/tools/supervised_recall.py --delay 256 gtrxl \\
        '{d_model: 32, num_layers: 2, num_heads: 2, window: 136, ff_mult: 2, encoder_sizes: [32]}'
    python scripts/tools/supervised_recall.py --delay 256 lru '{hidden_size: 128}' --steps 200
    python scripts/tools/supervised_recall.py --task repeat_previous --k 32 --decks 2 --lr 5e-4 gtrxl \\
        '{d_model: 64, num_layers: 1, num_heads: 4, window: 128, encoder_sizes: [128], recurrence: gru}'
"""

from __future__ import annotations

import argparse
import sys
import time

import gymnasium as gym
import numpy as np
import torch
import yaml
from tensordict import TensorDict

from rl_replay.agent import build_agent


def memory_cue_batch(delay: int, B: int):
    """MemoryCue-shaped episodes: (observations, is_first, a (T, B) mask of labelled steps, labels)."""
    T = delay + 2
    cue = torch.randint(0, 2, (B,))  # torch's global generator, seeded by --seed
    obs = torch.zeros(T, B, 4)
    obs[0, torch.arange(B), cue] = 1.0
    obs[-1, :, 2] = 1.0
    labelled = torch.zeros(T, B, dtype=torch.bool)
    labelled[-1] = True
    labels = torch.zeros(T, B, dtype=torch.int64)
    labels[-1] = cue
    return obs, labelled, labels


def repeat_previous_batch(k: int, decks: int, B: int, rng: np.random.Generator):
    """RepeatPrevious-shaped episodes as the PreviousAction wrapper presents them (one-hot leaves);
    ``k = 0`` labels them as RepeatFirst does."""
    cards = 52 * decks
    T = cards - 1  # the env's episode length: it ends with one card left in the deck
    suits = np.stack([rng.permutation(np.repeat(np.arange(4), cards // 4)) for _ in range(B)], 1)[:T]
    prev = np.zeros((T, B), dtype=np.int64)
    prev[1:] = rng.integers(0, 4, (T - 1, B))
    first = np.zeros((T, B), dtype=np.int64)
    first[0] = 1

    def one_hot(a, n):
        return torch.nn.functional.one_hot(torch.as_tensor(a), n).float()

    obs = TensorDict(
        {"obs": one_hot(suits, 4), "prev_action": one_hot(prev, 4), "is_first": one_hot(first, 2)}, batch_size=[T, B]
    )
    labelled, labels = repeat_previous_labels(torch.as_tensor(suits), k)
    return obs, labelled, labels


def repeat_previous_labels(suits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The labelled steps and labels of RepeatPrevious for the (T, B) suits seen at each step;
    ``k = 0``: RepeatFirst's (every step asks for the first suit)."""
    if k == 0:
        return torch.ones(suits.shape, dtype=torch.bool), suits[:1].expand(suits.shape).clone()
    # the env rewards the action at step t (0-based) for the suit seen at t - (k - 1), from t = k - 1 on
    labelled = torch.zeros(suits.shape, dtype=torch.bool)
    labelled[k - 1 :] = True
    labels = torch.zeros(suits.shape, dtype=torch.int64)
    labels[k - 1 :] = suits[: suits.shape[0] - (k - 1)]
    return labelled, labels


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="agent.target, e.g. gtrxl")
    parser.add_argument("kwargs", nargs="?", default="{}", help="agent.kwargs as YAML")
    parser.add_argument("--task", choices=("memory_cue", "repeat_previous", "repeat_first"), default="memory_cue")
    parser.add_argument("--delay", type=int, default=256, help="memory_cue: steps between the cue and the query")
    parser.add_argument("--k", type=int, default=32, help="repeat_previous: the env's k (Medium 32, Hard 64)")
    parser.add_argument("--decks", type=int, default=2, help="repeat_previous: decks (Medium 2, Hard 3)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--every", type=int, default=50, help="print every this many steps")
    args = parser.parse_args(argv)
    if args.task == "repeat_previous" and not 1 <= args.k < 52 * args.decks:
        parser.error(f"--k {args.k} must lie in [1, {52 * args.decks - 1}] for {args.decks} deck(s)")
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    if args.task == "memory_cue":
        obs_space: gym.Space = gym.spaces.Box(-1.0, 1.0, (4,))
        act_space = gym.spaces.Discrete(2)
    else:
        d4 = gym.spaces.Discrete(4)
        obs_space = gym.spaces.Dict({"obs": d4, "prev_action": d4, "is_first": gym.spaces.Discrete(2)})
        act_space = d4
    agent = build_agent(args.target, yaml.safe_load(args.kwargs) or {}, obs_space, act_space)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.lr)
    B = args.batch
    t0 = time.perf_counter()
    for step in range(args.steps):
        if args.task == "memory_cue":
            obs, labelled, labels = memory_cue_batch(args.delay, B)
        else:
            k = 0 if args.task == "repeat_first" else args.k
            obs, labelled, labels = repeat_previous_batch(k, args.decks, B, rng)
        is_first = torch.zeros(labelled.shape, dtype=torch.bool)
        is_first[0] = True
        logits = agent(observation=obs, state=agent.initial_state(B), is_first=is_first)["outputs", "dist", "logits"]
        loss = torch.nn.functional.cross_entropy(logits[labelled], labels[labelled])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % args.every == 0 or step == args.steps - 1:
            accuracy = (logits[labelled].argmax(-1) == labels[labelled]).float().mean().item()
            print(f"step {step}: loss {loss.item():.3f}, accuracy {accuracy:.2f}, {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
