"""Run a trained agent for whole episodes and report its returns."""

from __future__ import annotations

import numpy as np
import torch

from rl_replay.agent import Agent
from rl_replay.errors import SetupError
from rl_replay.rollout.env_state import apply_statistics
from rl_replay.rollout.environment import make_env, make_vector_env, step_envs
from rl_replay.rollout.episodes import Episode, EpisodeTracker, env_action
from rl_replay.rollout.sequence import step_inputs
from rl_replay.spaces import obs_converter
from rl_replay.targets import OWN, Importer

__all__ = ["evaluate", "log_evaluation"]


@torch.no_grad()
def evaluate(
    agent: Agent,
    env_id: str,
    *,
    episodes: int = 10,
    num_envs: int = 8,
    deterministic: bool = True,
    seed: int = 12345,
    env_kwargs: dict | None = None,
    max_episode_steps: int | None = None,
    device: torch.device | str = "cpu",
    video_dir: str | None = None,
    env_imports: tuple[str, ...] | list[str] = (),
    env_wrappers: tuple[dict, ...] | list[dict] = (),
    env_statistics: list[dict] | None = None,
    env_observation_keys: tuple[str, ...] | list[str] = (),
    vectorization: str = "sync",
    importer: Importer = OWN,
) -> dict[str, float]:
    """Play ``episodes`` full episodes; returns mean/std return, mean length, success rate.

    ``deterministic`` takes the distribution's mode instead of sampling.
    ``video_dir`` records the first env's episodes with gymnasium's RecordVideo
    (needs the optional ``moviepy`` dependency and an env with ``rgb_array`` rendering).
    ``env_imports``, ``env_wrappers`` and ``env_observation_keys`` are the run's ``env.imports``,
    ``env.wrappers`` and ``env.observation_keys``; ``env_statistics``
    (:func:`rl_replay.rollout.env_state.training_statistics`) are the training run's wrapper statistics
    (``NormalizeObservation``...): every env gets them, frozen, so the agent sees inputs scaled
    as in training. None leaves the wrappers' own (fresh) statistics.
    ``vectorization`` is the run's ``env.vectorization`` (``async`` plays as ``sync``: the
    episodes are the same). ``importer`` is the run config's (:class:`~rl_replay.targets.Importer`).
    The agent runs in eval mode; its previous training mode is restored afterwards.
    """
    kwargs = dict(env_kwargs or {})
    # the env's own vector env, or EnvPool's (whose preprocessing gymnasium's single env would not have)
    own = video_dir is None and vectorization in ("vector_entry_point", "envpool")
    if video_dir is not None:
        import gymnasium as gym
        from gymnasium.wrappers import RecordVideo

        # One env, every episode recorded (RecordVideo needs rgb_array rendering).
        env = make_env(
            env_id,
            imports=env_imports,
            wrappers=env_wrappers,
            kwargs=kwargs,
            max_episode_steps=max_episode_steps,
            render_mode="rgb_array",
            observation_keys=env_observation_keys,
            importer=importer,
        )
        recorded = RecordVideo(env, video_dir, episode_trigger=lambda episode: True, disable_logger=True)
        num_envs = 1
        vector_env = gym.vector.SyncVectorEnv([lambda: recorded])
    else:
        vector_env = make_vector_env(  # type: ignore[assignment]
            env_id,
            num_envs,
            vectorization=vectorization if own else "sync",
            kwargs=kwargs,
            max_episode_steps=max_episode_steps,
            imports=env_imports,
            wrappers=env_wrappers,
            observation_keys=env_observation_keys,
            importer=importer,
        )
    # An env's own vector env takes no wrappers, so it has no statistics to be given.
    if env_statistics is not None and not own:
        try:
            for env in vector_env.envs:
                apply_statistics(env, env_statistics, freeze=True)
        except SetupError:
            vector_env.close()
            raise
    device = torch.device(device)
    to_tensor = obs_converter(vector_env.single_observation_space, device)
    was_training = agent.training
    agent.eval()
    try:
        return _play(agent, vector_env, to_tensor, episodes, num_envs, deterministic, seed, device, env_id)
    finally:
        vector_env.close()
        agent.train(was_training)


def _play(
    agent, vector_env, to_tensor, episodes, num_envs, deterministic, seed, device, env_id: str
) -> dict[str, float]:
    obs, _ = vector_env.reset(seed=seed)
    state = agent.initial_state(num_envs, device)
    is_first = torch.ones(num_envs, dtype=torch.bool, device=device)
    tracker = EpisodeTracker(num_envs)
    ended: list[Episode] = []
    while len(ended) < episodes:
        out = agent(**step_inputs(to_tensor(obs), state, is_first))
        dist = agent.distribution(out["outputs"])
        action = (dist.mode if deterministic else dist.sample())[0]
        valid = tracker.real_steps()
        obs, reward, terminated, truncated, info = step_envs(
            vector_env, env_action(action, vector_env.single_action_space), env_id
        )
        finished, first = tracker.step(reward, terminated, truncated, info, valid)
        ended += finished
        state = out["state"]
        is_first = torch.as_tensor(first, device=device)
    ended = ended[:episodes]
    returns = [e.ret for e in ended]
    successes = [e.success for e in ended if e.success is not None]
    result = {
        "return_mean": float(np.mean(returns)),
        "return_std": float(np.std(returns)),
        "episode_length": float(np.mean([e.length for e in ended])),
        "episodes": float(len(ended)),
    }
    if successes:
        result["success_rate"] = float(np.mean(successes))
    return result


def log_evaluation(
    run_dir,
    cfg,
    result: dict[str, float],
    *,
    checkpoint: dict,
    video_dir: str | None = None,
    deterministic: bool = True,
    seed: int = 12345,
) -> str:
    """Log an evaluation to the training run's wandb project as a run of ``job_type="eval"``.

    The eval run joins the training run's group (``log.group``, else the run directory's
    name), records the training run's wandb id and the checkpoint's update and env steps
    in its config, puts ``eval/*`` in its summary and, with ``video_dir``, the recorded
    videos. It is written next to the training run's wandb files (``RUN_DIR/wandb``),
    so one ``wandb sync`` uploads both. ``WANDB_MODE`` wins over ``log.wandb_mode``.
    Returns the mode used (``disabled`` logs nothing).
    """
    from pathlib import Path

    from rl_replay.run.logger import wandb_preflight
    from rl_replay.rundir.files import held

    run_dir = Path(run_dir)
    mode = wandb_preflight(cfg.log.wandb_mode)
    if mode == "disabled":
        return mode
    with held(run_dir) as d:
        d.check_directory("wandb", "wandb directory")
    import wandb

    name = cfg.log.run_name or run_dir.name
    run = wandb.init(
        project=cfg.log.wandb_project,
        entity=cfg.log.wandb_entity,
        dir=str(run_dir),
        mode=mode,  # type: ignore[arg-type]
        name=f"{name}-eval",
        group=cfg.log.group or name,
        tags=list(cfg.log.tags) or None,
        job_type="eval",
        config={
            "train_run_id": checkpoint.get("wandb_id"),
            "checkpoint_update": checkpoint["update"],
            "checkpoint_env_steps": checkpoint["env_steps"],
            "deterministic": deterministic,
            "seed": seed,
            "env": {"id": cfg.env.id},
        },
        settings=wandb.Settings(init_timeout=15) if mode == "online" else None,
    )
    try:
        run.define_metric("env_steps")
        run.define_metric("eval/*", step_metric="env_steps")
        row = {"env_steps": checkpoint["env_steps"], **{f"eval/{k}": v for k, v in result.items()}}
        if video_dir is not None:
            videos = sorted(Path(video_dir).glob("*.mp4"))
            if videos:
                row["eval/video"] = wandb.Video(str(videos[-1]), format="mp4")
        run.log(row)
        run.summary.update({f"eval/{k}": v for k, v in result.items()})
    finally:
        run.finish()
    return mode
