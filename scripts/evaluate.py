"""Evaluate a checkpoint: run N episodes and print the mean and std of the return.

    python scripts/evaluate.py runs/CartPole-v1-20261130-101500 --episodes 100
    python scripts/evaluate.py RUN_DIR --video videos/   # needs: pip install -e ".[video]"
    python scripts/evaluate.py RUN_DIR --wandb           # also log the result to the run's wandb project

Works for checkpoints written by one process or by several (FSDP) processes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="run directory (with config.yaml and checkpoint.pt)")
    parser.add_argument("--episodes", type=int, default=None, help="default: eval.episodes of the run's config")
    parser.add_argument("--stochastic", action="store_true", help="sample actions instead of the mode")
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--video", default=None, metavar="DIR", help="record videos into DIR")
    parser.add_argument("--wandb", action="store_true",
                        help="log the result (and video) to the training run's wandb project, as an eval run "
                             "in its group (mode: WANDB_MODE, else the run's log.wandb_mode)")
    args = parser.parse_args(argv)

    from rl_replay.agent import build_agent
    from rl_replay.checkpoint import load_checkpoint
    from rl_replay.collector import make_vector_env
    from rl_replay.config import load_config
    from rl_replay.errors import SetupError
    from rl_replay.evaluate import evaluate

    run_dir = Path(args.run_dir)
    try:
        cfg = load_config(run_dir / "config.yaml")
        state = load_checkpoint(run_dir)
        probe = make_vector_env(cfg.env.id, 1, kwargs=cfg.env.kwargs, max_episode_steps=cfg.env.max_episode_steps,
                                imports=cfg.env.imports, wrappers=cfg.env.wrappers)
        agent = build_agent(cfg.agent.target, cfg.agent.kwargs, probe.single_observation_space,
                            probe.single_action_space)
        probe.close()
        if args.wandb:
            from rl_replay.logger import wandb_preflight

            wandb_preflight(cfg.log.wandb_mode)  # fail before evaluating, not after
    except (SetupError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    agent.load_state_dict(state["agent"])
    if args.video:
        try:
            import moviepy  # noqa: F401
        except ImportError:
            print("error: --video needs the optional video dependency: pip install -e '.[video]'", file=sys.stderr)
            return 2
    result = evaluate(
        agent, cfg.env.id, episodes=args.episodes or cfg.eval.episodes,
        deterministic=cfg.eval.deterministic and not args.stochastic, seed=args.seed,
        env_kwargs=cfg.env.kwargs, max_episode_steps=cfg.env.max_episode_steps, video_dir=args.video,
        env_imports=cfg.env.imports, env_wrappers=cfg.env.wrappers,
    )
    print(f"return {result['return_mean']:.2f} +- {result['return_std']:.2f} over "
          f"{int(result['episodes'])} episodes (checkpoint update {state['update']}, "
          f"{state['env_steps']} env steps)")
    print(json.dumps(result))
    if args.wandb:
        from rl_replay.evaluate import log_evaluation

        mode = log_evaluation(run_dir, cfg, result, checkpoint=state, video_dir=args.video,
                              deterministic=cfg.eval.deterministic and not args.stochastic, seed=args.seed)
        print(f"wandb: evaluation logged ({mode}) to project {cfg.log.wandb_project}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
