"""What a POPGym score means: hand-written policies played on popgym's own envs, and the MMER a fixed
policy would be expected to get from noise alone.

The table's MMER (``popgym_table.py``) is a maximum over training of 100-episode means. A policy
that never changes still gets more than its mean that way: with per-episode standard deviation
``s`` and ``n`` reports, the expected maximum is ``mean + s / 10 * E[max of n standard normals]``.
On envs whose best and simplest policies are a few hundredths apart (HigherLower) that term is as
large as the gap, so this tool prints both, at the reports a run of ``--env-steps`` would make.

Policies (each sees only what the agent sees: the observation and its own previous actions):

- ``HigherLowerEasy``: ``memoryless`` says "higher" when the shown rank is below the middle;
  ``counting`` counts the ranks dealt so far and says whichever side has more cards left.
- ``MultiarmedBanditEasy``: ``random``; ``explore_then_greedy`` pulls each arm once, then the arm
  with the best payout rate so far (Laplace-smoothed); ``thompson`` samples Beta posteriors;
  ``oracle`` knows the payout probabilities (read from the env, a ceiling no agent can reach).

    python scripts/tools/popgym_reference.py --episodes 2000 --env-steps 1260000 15000000
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import numpy as np

REPORT_EVERY = 65_536  # popgym_table.py's cadence: one report per RLlib training batch
WINDOW = 100  # episodes in each reported mean


def expected_max_of_normals(n: int, draws: int = 20_000, seed: int = 0) -> float:
    """E[max of n iid standard normals], by simulation (0 for n = 0)."""
    if n <= 0:
        return 0.0
    rng = np.random.default_rng(seed)
    return float(rng.standard_normal((draws, n)).max(axis=1).mean())


def reports(env_steps: int, episode_length: int) -> int:
    """Reports a run of ``env_steps`` makes: one per multiple of 65,536 env steps from the first at
    which 100 episodes have ended (episodes of ``episode_length``, as popgym_table.py reads them)."""
    first = -(-WINDOW * episode_length // REPORT_EVERY) * REPORT_EVERY  # ceil to a multiple
    return 0 if env_steps < first else 1 + (env_steps - first) // REPORT_EVERY


def higher_lower(policy: str) -> Callable[[np.random.Generator], float]:
    """One episode of HigherLowerEasy under ``policy`` (``memoryless`` or ``counting``)."""
    from popgym.envs.higher_lower import HigherLowerEasy

    def episode(rng: np.random.Generator) -> float:
        env = HigherLowerEasy()
        obs, _ = env.reset(seed=int(rng.integers(2**31)))
        left = np.full(13, 4.0)
        left[obs] -= 1
        total, done = 0.0, False
        while not done:
            if policy == "counting":
                higher = left[obs + 1 :].sum() >= left[:obs].sum()
            else:
                higher = obs < 6 or (obs == 6 and rng.random() < 0.5)
            obs, reward, terminated, truncated, _ = env.step(0 if higher else 1)
            left[obs] -= 1
            total += reward
            done = terminated or truncated
        return total

    return episode


def bandit(policy: str) -> Callable[[np.random.Generator], float]:
    """One episode of MultiarmedBanditEasy under ``policy``."""
    from popgym.envs.multiarmed_bandit import MultiarmedBanditEasy

    def episode(rng: np.random.Generator) -> float:
        env = MultiarmedBanditEasy()
        env.reset(seed=int(rng.integers(2**31)))
        arms = env.num_bandits
        wins, pulls = np.zeros(arms), np.zeros(arms)
        total, done, t = 0.0, False, 0
        while not done:
            if policy == "oracle":
                arm = int(np.argmax(env.bandits))
            elif policy == "thompson":
                arm = int(np.argmax(rng.beta(wins + 1, pulls - wins + 1)))
            elif policy == "explore_then_greedy":
                arm = t if t < arms else int(np.argmax((wins + 1) / (pulls + 2)))
            else:
                arm = int(rng.integers(arms))
            obs, reward, terminated, truncated, _ = env.step(arm)
            wins[arm] += obs
            pulls[arm] += 1
            total += reward
            done, t = terminated or truncated, t + 1
        return total

    return episode


#: env -> (episode length, its policies, policy name -> one episode of it)
POLICIES: dict[str, tuple[int, tuple[str, ...], Callable[[str], Callable[[np.random.Generator], float]]]] = {
    "HigherLowerEasy": (51, ("memoryless", "counting"), higher_lower),
    "MultiarmedBanditEasy": (200, ("random", "explore_then_greedy", "thompson", "oracle"), bandit),
}


def evaluate(env: str, policy: str, episodes: int, seed: int, env_steps: list[int]) -> dict:
    """Mean and per-episode spread of ``policy`` on ``env`` and its expected MMER at each budget."""
    length, _, episode_of = POLICIES[env]
    play = episode_of(policy)
    rng = np.random.default_rng(seed)
    returns = np.array([play(rng) for _ in range(episodes)])
    mean, std = float(returns.mean()), float(returns.std(ddof=1))
    expected = {}
    for steps in env_steps:
        n = reports(steps, length)
        expected[str(steps)] = mean + std / np.sqrt(WINDOW) * expected_max_of_normals(n) if n else None
    return {"env": env, "policy": policy, "episodes": episodes, "mean": mean, "std": std, "mmer_if_fixed": expected}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", choices=sorted(POLICIES), action="append", help="default: all")
    parser.add_argument("--episodes", type=int, default=2000, help="episodes per policy")
    parser.add_argument(
        "--env-steps", type=int, nargs="*", default=[15_000_000], help="budgets to give the expected MMER at"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args(argv)
    if args.episodes < 2:
        parser.error(f"--episodes must be >= 2 (a spread needs two), got {args.episodes}")
    if any(s <= 0 for s in args.env_steps):
        parser.error(f"--env-steps must be positive, got {args.env_steps}")
    try:
        import popgym  # noqa: F401
    except ImportError:
        parser.error("popgym is not installed: pip install -e '.[popgym]'")
    results = [
        evaluate(env, policy, args.episodes, args.seed, args.env_steps)
        for env in (args.env or sorted(POLICIES))
        for policy in POLICIES[env][1]
    ]
    budgets = " | ".join(f"MMER if fixed, {s / 1e6:g}M env steps" for s in args.env_steps)
    print(f"| env | policy | mean return | per-episode std | {budgets} |")
    print("|---|---|---:|---:|" + "---:|" * len(args.env_steps))
    for r in results:
        cells = " | ".join("-" if v is None else f"{v:.3f}" for v in r["mmer_if_fixed"].values())
        print(f"| {r['env']} | {r['policy']} | {r['mean']:.3f} | {r['std']:.3f} | {cells} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
