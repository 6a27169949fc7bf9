"""Run a trained agent for whole episodes and report its returns."""

from __future__ import annotations

import numpy as np
import torch

from rl_replay.agent import Agent
from rl_replay.collector import make_vector_env

__all__ = ["evaluate"]


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
) -> dict[str, float]:
    """Play ``episodes`` full episodes; returns mean/std return, mean length, success rate.

    ``deterministic`` takes the distribution's mode instead of sampling.
    ``video_dir`` records the first env's episodes with gymnasium's RecordVideo
    (needs the optional ``moviepy`` dependency and an env with ``rgb_array`` rendering).
    """
    kwargs = dict(env_kwargs or {})
    if video_dir is not None:
        import gymnasium as gym
        from gymnasium.wrappers import RecordVideo

        import envs as _registered  # noqa: F401  (the rl_replay/* ids)

        # One env, every episode recorded (RecordVideo needs rgb_array rendering).
        if max_episode_steps is not None:
            kwargs["max_episode_steps"] = max_episode_steps
        recorded = RecordVideo(gym.make(env_id, render_mode="rgb_array", **kwargs), video_dir,
                               episode_trigger=lambda episode: True, disable_logger=True)
        num_envs = 1
        vector_env = gym.vector.SyncVectorEnv([lambda: recorded])
    else:
        vector_env = make_vector_env(env_id, num_envs, kwargs=kwargs, max_episode_steps=max_episode_steps)
    device = torch.device(device)
    agent.eval()
    obs, _ = vector_env.reset(seed=seed)
    state = agent.initial_state(num_envs, device)
    is_first = torch.ones(num_envs, dtype=torch.bool, device=device)
    autoreset = np.zeros(num_envs, dtype=bool)
    ep_return, ep_length = np.zeros(num_envs), np.zeros(num_envs, dtype=np.int64)
    returns, lengths, successes = [], [], []
    while len(returns) < episodes:
        out = agent(observation=torch.as_tensor(obs, dtype=torch.float32, device=device),
                    state=state, is_first=is_first)
        dist = agent.distribution(out)
        action = dist.mode if deterministic else dist.sample()
        a = action.cpu().numpy()
        obs, reward, terminated, truncated, info = vector_env.step(a)
        valid = ~autoreset
        ep_return += np.where(valid, reward, 0.0)
        ep_length += valid
        done = (terminated | truncated) & valid
        for i in np.flatnonzero(done):
            if len(returns) < episodes:
                returns.append(ep_return[i])
                lengths.append(ep_length[i])
                # Vector envs mark which sub-envs reported a key with "_<key>".
                if "success" in info and info.get("_success", np.ones(len(done), bool))[i]:
                    successes.append(float(info["success"][i]))
            ep_return[i], ep_length[i] = 0.0, 0
        state = out["state"]
        is_first = torch.as_tensor(autoreset, device=device)
        autoreset = terminated | truncated
    vector_env.close()
    result = {
        "return_mean": float(np.mean(returns)),
        "return_std": float(np.std(returns)),
        "episode_length": float(np.mean(lengths)),
        "episodes": float(len(returns)),
    }
    if successes:
        result["success_rate"] = float(np.mean(successes))
    return result
