"""What a trained policy on a card game conditions on: a diagnosis of a run, not a score.

Plays ``--episodes`` episodes of the run's environment with its checkpoint, sampling actions as in
training, and prints:

- the action histogram and the policy's mean entropy;
- how often the action equals the previous action, and how often it equals the card shown ``lag``
  steps before (``--lags``; POPGym's RepeatPrevious asks for ``k - 1`` steps back) and the card the
  episode opened with (RepeatFirst's answer), beside chance;
- how much the value and the action probabilities change when only the previous action on the
  observation is changed: every state of the episodes is evaluated again with each possible
  previous action, the same recurrent state and the same step.

An agent that answers from the card it should recall agrees with that card far above chance; a
policy that drifted to one answer shows one large bar in the histogram and chance agreement; a value
that moves with the previous action is what bootstrapping turns into a bias towards some actions
(docs/learning/popgym.md, fourth sitting). Needs a run whose observation is a Dict with an ``obs``
card (one integer) and a ``prev_action`` entry (``rl_replay.envs.wrappers:PreviousAction``), and a
discrete action space. A run whose config you did not write is read as ``scripts/evaluate.py``
reads it (``--trust-config`` to let it import what it names).

    python scripts/tools/policy_probe.py runs/rpm_s1 --episodes 16 --lags 1 31 32
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def probe(run_dir: Path, episodes: int, lags: list[int], seed: int, trust_config: bool) -> dict:
    """The statistics listed in the module's docstring, as a dict (see ``main`` for the printout)."""
    import gymnasium as gym

    from rl_replay.errors import SetupError
    from rl_replay.rollout.environment import envs_from_config
    from rl_replay.rundir.door import RunDirectory, Trust
    from rl_replay.spaces import obs_converter

    with RunDirectory.open(run_dir, trust=Trust(config=trust_config)) as run:
        run_config = run.config()  # a foreign config's targets are checked here
        cfg = run_config.cfg
        envs = envs_from_config(cfg.env, episodes, importer=run.importer(run_config))
        try:
            space, actions = envs.single_observation_space, envs.single_action_space
            if not (isinstance(space, gym.spaces.Dict) and {"obs", "prev_action"} <= set(space.spaces)):
                raise SetupError(
                    f"{run_dir}'s observation is {space}, not a Dict with 'obs' and 'prev_action': "
                    "the probe needs the PreviousAction wrapper (configs/popgym/base.yaml)"
                )
            if not isinstance(actions, gym.spaces.Discrete):
                raise SetupError(f"{run_dir}'s action space is {actions}; the probe needs a Discrete one")
            agent = run.agent(run_config, run.checkpoint("the policy probe"))
            agent.eval()
            return _play(agent, envs, obs_converter(space), int(actions.n), lags, seed, cfg.collector.num_steps)
        finally:
            envs.close()


def _play(agent, envs, convert, n: int, lags: list[int], seed: int, max_steps: int) -> dict:
    import torch

    from rl_replay.algorithms.stored import OneStep

    generator = torch.Generator().manual_seed(seed)
    obs, _ = envs.reset(seed=seed)
    num = envs.num_envs
    state = agent.initial_state(num, "cpu")
    step = OneStep(agent)  # one step: outputs (num,) beside the next state
    first = torch.ones(num, dtype=torch.bool)
    alive = np.ones(num, dtype=bool)  # each env plays one episode; finished ones are masked out
    cards, acts, masks, entropies, value_spread, value_std, prob_change = [], [], [], [], [], [], []
    with torch.no_grad():
        for t in range(max_steps):
            out = step(observation=convert(obs), state=state, is_first=first)
            dist = agent.distribution(out)
            if alive.sum() > 1:  # how much the value differs between episodes at the same step
                value_std.append(float(out["value"].reshape(num)[torch.from_numpy(alive)].std()))
            if t > 0:
                values, probs = [], []
                for a in range(n):
                    changed = dict(obs, prev_action=np.full_like(np.asarray(obs["prev_action"]), a))
                    alt = step(observation=convert(changed), state=state, is_first=first)
                    values.append(alt["value"].reshape(num))
                    probs.append(agent.distribution(alt).probs.reshape(num, n))
                v, p = torch.stack(values), torch.stack(probs)
                value_spread.append((v.amax(0) - v.amin(0)).numpy()[alive])
                prob_change.append((p.amax(0) - p.amin(0)).amax(-1).numpy()[alive])
            probs_now = dist.probs.reshape(num, n)
            action = torch.multinomial(probs_now, 1, generator=generator).reshape(num)
            cards.append(np.asarray(obs["obs"]).reshape(num).copy())
            acts.append(action.numpy())
            masks.append(alive.copy())
            entropies.append(dist.entropy().reshape(num).numpy()[alive])
            obs, _, terminated, truncated, _ = envs.step(action.numpy())
            alive &= ~(np.asarray(terminated) | np.asarray(truncated))
            state, first = out["state"], torch.zeros(num, dtype=torch.bool)
            if not alive.any():
                break
    card, act, mask = np.array(cards), np.array(acts), np.array(masks)

    def agree(lag: int) -> float:
        both = mask[lag:] & mask[: len(mask) - lag]
        return float((act[lag:] == card[: len(card) - lag])[both].mean())

    both = mask[1:] & mask[:-1]
    return {
        "steps": int(mask.sum()),
        "entropy": float(np.concatenate(entropies).mean()),
        "histogram": (np.bincount(act[mask], minlength=n) / mask.sum()).tolist(),
        "repeats_previous_action": float((act[1:] == act[:-1])[both].mean()),
        "agrees_with_card": {lag: agree(lag) for lag in sorted({0, *lags}) if lag < len(card)},
        # RepeatFirst's answer: the card each episode opened with
        "agrees_with_first_card": float((act == card[:1])[mask].mean()),
        "chance": 1.0 / n,
        "value_spread_over_previous_action": float(np.concatenate(value_spread).mean()) if value_spread else None,
        "value_std_across_envs": float(np.mean(value_std)) if value_std else None,
        "largest_probability_change_over_previous_action": float(np.concatenate(prob_change).mean())
        if prob_change
        else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="run directory (config.yaml, checkpoint.pt)")
    parser.add_argument("--episodes", type=int, default=16, help="episodes played side by side (default 16)")
    parser.add_argument("--lags", type=int, nargs="*", default=[1], help="card lags to compare the action with")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--trust-config", action="store_true", help="as scripts/evaluate.py's")
    args = parser.parse_args(argv)
    if args.episodes < 1:
        parser.error(f"--episodes must be >= 1, got {args.episodes}")
    if any(lag < 0 for lag in args.lags):
        parser.error(f"--lags must be >= 0, got {args.lags}")
    import torch

    torch.set_num_threads(1)
    from rl_replay.errors import SetupError, one_line

    try:
        r = probe(args.run_dir, args.episodes, args.lags, args.seed, args.trust_config)
    except (SetupError, ValueError, FileNotFoundError) as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    print(f"{r['steps']} steps of {args.episodes} episodes, sampled actions; entropy {r['entropy']:.3f}")
    print("action histogram: " + " ".join(f"{p:.3f}" for p in r["histogram"]))
    print(f"action == previous action: {r['repeats_previous_action']:.3f} (chance {r['chance']:.3f})")
    for lag, frac in r["agrees_with_card"].items():
        print(f"action == card {lag} steps back: {frac:.3f} (chance {r['chance']:.3f})")
    print(f"action == the episode's first card: {r['agrees_with_first_card']:.3f} (chance {r['chance']:.3f})")
    if r["value_spread_over_previous_action"] is not None:
        print(
            f"changing only the previous action: value spread {r['value_spread_over_previous_action']:.4f} "
            f"(value std across episodes {r['value_std_across_envs']:.4f}), "
            f"largest action-probability change {r['largest_probability_change_over_previous_action']:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
