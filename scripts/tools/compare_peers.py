"""Run a peer baseline (sb3-contrib RecurrentPPO) on an env and log it like the trainer does.

Writes ``OUT_DIR/metrics.jsonl`` with one line per RecurrentPPO iteration (rollout + update),
in the trainer's format, so the same curve tools read both:

==========================  ==========================================================
``update``, ``env_steps``    iteration number, env steps so far (all envs)
``rollout/return_recent``    mean return of the last 100 finished episodes
``rollout/success_rate``     fraction of this iteration's finished episodes whose final
                             ``info["success"]`` is true (envs that report it)
``rollout/episodes``         episodes finished in this iteration
``memory/peak_rss_bytes``    peak resident set size of this process so far
``time/steps_per_sec``       env steps per second of this iteration (collect + update)
==========================  ==========================================================

and ``OUT_DIR/peer.json`` with the exact settings. Non-Box observation spaces (POPGym's
Discrete / MultiDiscrete) are one-hot encoded with ``gymnasium.wrappers.FlattenObservation``.

``--config`` takes the env of one of the project's configs instead (id, ``env.imports``,
``env.wrappers``, ``env.kwargs``, ``env.observation_keys``), so the peer sees exactly the
observations and actions the trainer's agent sees. ``--grid-cnn SCALE`` gives RecurrentPPO the
project's ``grid_cnn`` (16 2x2, max-pool, 32 2x2, 64 2x2) as its features extractor, the image
times SCALE and the Dict's other keys (one-hot) concatenated: SB3's own NatureCNN needs frames of
at least 36x36, and MiniGrid's views are 7x7 grids of small indices.

Needs the optional extra: ``pip install -e ".[compare]"``. Examples::

    python scripts/tools/compare_peers.py --env rl_replay/MemoryCue-v0 --env-kwargs '{delay: 256}' \\
        --total-env-steps 2000000 --out runs/peer_memory256
    python scripts/tools/compare_peers.py --env popgym-RepeatPreviousEasy-v0 --total-env-steps 300000 \\
        --out runs/peer_repeatprevious      # POPGym ids need `pip install popgym`
    python scripts/tools/compare_peers.py --config configs/minigrid_memory_s7.yaml --policy MultiInputLstmPolicy \\
        --grid-cnn 1.0 --grid-cnn-layout hwc --total-env-steps 2500000 --out runs/peer_s7
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import gymnasium
import numpy as np
import yaml

from rl_replay.run.logger import METRICS_NAME


def _yaml_mapping(text: str, flag: str) -> dict:
    value = yaml.safe_load(text) if text else {}
    if not isinstance(value, dict):
        raise SystemExit(f"compare_peers: {flag} must be a YAML mapping such as '{{delay: 256}}', got {text!r}.")
    return value


def import_env_modules(env_id: str) -> None:
    """Register the project's envs, and POPGym's when the id asks for them."""
    import rl_replay.envs  # noqa: F401  (rl_replay/* ids)

    if env_id.startswith("popgym-"):
        try:
            import popgym  # noqa: F401
        except ImportError:
            raise SystemExit(f"compare_peers: {env_id} needs popgym: pip install popgym") from None


def make_env_fn(env_id: str, kwargs: dict):
    def make():
        env = gymnasium.make(env_id, **kwargs)
        if not isinstance(env.observation_space, gymnasium.spaces.Box):
            env = gymnasium.wrappers.FlattenObservation(env)  # Discrete -> one-hot
        return env

    return make


def make_config_env_fn(config_path: str):
    """The env of a project config, built as the trainer builds each of its sub-envs."""
    from rl_replay.config import load_config
    from rl_replay.rollout.environment import make_env

    env_cfg = load_config(config_path).env

    def make():
        return make_env(
            env_cfg.id,
            imports=env_cfg.imports,
            wrappers=env_cfg.wrappers,
            kwargs=env_cfg.kwargs,
            max_episode_steps=env_cfg.max_episode_steps,
            observation_keys=env_cfg.observation_keys,
        )

    return make, env_cfg


def grid_cnn_extractor():
    """An SB3 features extractor over the project's ``grid_cnn`` (for MiniGrid-size views)."""
    import torch
    from stable_baselines3.common.preprocessing import get_flattened_obs_dim
    from stable_baselines3.common.torch_layers import BaseFeaturesExtractor

    from rl_replay.agents.encoders import grid_cnn
    from rl_replay.agents.encoders import image_layout as image_layout_of

    class GridCNN(BaseFeaturesExtractor):
        """``grid_cnn`` on the image (channel-first, as SB3's VecTransposeImage hands it over)
        times ``image_scale``, then the flattened other keys of a Dict observation."""

        def __init__(self, observation_space, image_scale: float = 0.1, image_layout: str | None = None):
            super().__init__(observation_space, features_dim=1)
            spaces = (
                dict(observation_space.spaces)
                if isinstance(observation_space, gymnasium.spaces.Dict)
                else {None: observation_space}
            )
            images = [k for k, sp in spaces.items() if len(sp.shape or ()) == 3]
            if len(images) != 1:
                raise SystemExit(f"compare_peers: --grid-cnn needs exactly one image in {observation_space}")
            self.image_key = images[0]
            self.other_keys = [k for k in spaces if k != self.image_key]
            self.image_scale = float(image_scale)
            # The image as SB3 hands it over: VecTransposeImage moves channels first only where
            # its own guess says they are last, so the layout is read from the space it gives.
            layout, (c, h, w) = image_layout_of(spaces[self.image_key].shape, image_layout)
            self.channel_last = layout == "hwc"
            self.convs = grid_cnn(c)
            with torch.no_grad():
                conv_dim = self.convs(torch.zeros(1, c, h, w)).flatten(1).shape[1]
            self._features_dim = conv_dim + sum(get_flattened_obs_dim(spaces[k]) for k in self.other_keys)

        def forward(self, observations):
            image = observations if self.image_key is None else observations[self.image_key]
            if self.channel_last:
                image = image.permute(0, 3, 1, 2)
            x = self.convs(image.float() * self.image_scale).flatten(1)
            rest = [observations[k].flatten(1).float() for k in self.other_keys]
            return torch.cat([x, *rest], dim=1) if rest else x

    return GridCNN


def build_callback(metrics_path: Path, window: int = 100):
    from stable_baselines3.common.callbacks import BaseCallback

    from rl_replay.run.memory_stats import update_memory

    class MetricsCallback(BaseCallback):
        """Per-iteration records in the trainer's metrics.jsonl format."""

        def _on_training_start(self) -> None:
            self.file = open(metrics_path, "x", buffering=1)
            self.recent = collections.deque(maxlen=window)
            self.update = 0
            self.episodes = self.judged = self.success = 0
            self.last_time, self.last_steps = time.perf_counter(), self.num_timesteps

        def _on_step(self) -> bool:
            for done, info in zip(self.locals["dones"], self.locals["infos"]):
                if not done:
                    continue
                if "episode" in info:  # added by SB3's Monitor at the episode's end
                    self.recent.append(float(info["episode"]["r"]))
                    self.episodes += 1
                if "success" in info:
                    self.judged += 1
                    self.success += bool(info["success"])
            return True

        def _on_rollout_end(self) -> None:
            # SB3 calls this after collecting, before the update; the update's time is
            # counted in the next record, so steps/s covers collect + update like the trainer's.
            now = time.perf_counter()
            self.update += 1
            record = {"update": self.update, "env_steps": int(self.num_timesteps), "rollout/episodes": self.episodes}
            if self.recent:
                record["rollout/return_recent"] = float(np.mean(self.recent))
            if self.judged:
                record["rollout/success_rate"] = self.success / self.judged
            record.update(update_memory(self.model.device))
            record["time/steps_per_sec"] = (self.num_timesteps - self.last_steps) / (now - self.last_time)
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()  # one line per iteration on disk: a long run can be watched, a killed one keeps its rows
            self.last_time, self.last_steps = now, self.num_timesteps
            self.episodes = self.judged = self.success = 0

        def _on_training_end(self) -> None:
            self.file.close()

    return MetricsCallback()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--env", help="gymnasium id, e.g. rl_replay/MemoryCue-v0")
    source.add_argument(
        "--config",
        help="a project config whose env (id, imports, wrappers, kwargs, observation_keys) the peer trains on",
    )
    parser.add_argument(
        "--policy",
        default="MlpLstmPolicy",
        help="RecurrentPPO policy: MlpLstmPolicy, CnnLstmPolicy or MultiInputLstmPolicy",
    )
    parser.add_argument(
        "--grid-cnn",
        type=float,
        default=None,
        metavar="SCALE",
        help="the project's grid_cnn as features extractor, the image times SCALE",
    )
    parser.add_argument(
        "--grid-cnn-layout",
        choices=("hwc", "chw"),
        default=None,
        help="the image layout the extractor receives where the shape does not tell "
        "(MiniGrid's one-hot (7, 7, 20) views: hwc)",
    )
    parser.add_argument("--env-kwargs", default="", help="YAML mapping passed to gymnasium.make")
    parser.add_argument("--total-env-steps", type=int, required=True, help="env steps, all envs together")
    parser.add_argument("--num-envs", type=int, default=8)
    parser.add_argument(
        "--algo-kwargs", default="", help="YAML mapping of RecurrentPPO arguments (default: sb3-contrib's, n_steps 128)"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    args = parser.parse_args(argv)

    env_kwargs = _yaml_mapping(args.env_kwargs, "--env-kwargs")
    algo_kwargs = _yaml_mapping(args.algo_kwargs, "--algo-kwargs")
    if args.total_env_steps < 1 or args.num_envs < 1:
        parser.error("--total-env-steps and --num-envs must be positive")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        parser.error(f"--out {out} is not empty; pass a new directory (results are never overwritten)")
    try:
        import torch
        from sb3_contrib import RecurrentPPO
        from stable_baselines3.common.env_util import make_vec_env
    except ImportError as exc:
        raise SystemExit(f'compare_peers: needs the peer libraries ({exc}): pip install -e ".[compare]"') from None
    if args.config is not None:
        if env_kwargs:
            parser.error("--env-kwargs goes with --env; with --config the config's env.kwargs apply")
        env_fn, env_cfg = make_config_env_fn(args.config)
        env_name = env_cfg.id
    else:
        import_env_modules(args.env)
        try:
            gymnasium.spec(args.env)
        except gymnasium.error.Error as exc:
            parser.error(f"--env {args.env}: {exc}")
        env_fn, env_name = make_env_fn(args.env, env_kwargs), args.env
    if args.grid_cnn is not None:
        if not args.grid_cnn > 0:
            parser.error(f"--grid-cnn SCALE must be positive, got {args.grid_cnn}")
        policy_kwargs = dict(algo_kwargs.pop("policy_kwargs", None) or {})
        policy_kwargs.update(
            features_extractor_class=grid_cnn_extractor(),
            features_extractor_kwargs={"image_scale": args.grid_cnn, "image_layout": args.grid_cnn_layout},
            normalize_images=False,
        )
        algo_kwargs["policy_kwargs"] = policy_kwargs

    torch.set_num_threads(args.threads)
    vec_env = make_vec_env(env_fn, n_envs=args.num_envs, seed=args.seed)
    model = RecurrentPPO(args.policy, vec_env, seed=args.seed, device="cpu", verbose=0, **algo_kwargs)
    out.mkdir(parents=True, exist_ok=True)
    algo_kwargs.pop("policy_kwargs", None)
    settings = {
        "peer": "sb3_contrib.RecurrentPPO",
        "policy": args.policy,
        "env": env_name,
        "config": args.config,
        "grid_cnn_image_scale": args.grid_cnn,
        "grid_cnn_layout": args.grid_cnn_layout,
        "env_kwargs": env_kwargs,
        "num_envs": args.num_envs,
        "total_env_steps": args.total_env_steps,
        "seed": args.seed,
        "algo_kwargs": algo_kwargs,
        "n_steps": model.n_steps,
        "observation_space": str(vec_env.observation_space),
    }
    (out / "peer.json").write_text(json.dumps(settings, indent=1) + "\n")
    start = time.perf_counter()
    try:
        model.learn(total_timesteps=args.total_env_steps, callback=build_callback(out / METRICS_NAME))
    except KeyboardInterrupt:
        # `timeout -s INT` is how a peer run gets a wall-clock budget: a stop, not a crash. The
        # metrics file is line-buffered, so every finished iteration is already on disk.
        print(
            f"compare_peers: stopped by SIGINT after {model.num_timesteps} env steps "
            f"({time.perf_counter() - start:.1f} s); metrics so far in {out / METRICS_NAME}"
        )
        return 130
    print(
        f"compare_peers: {model.num_timesteps} env steps in {time.perf_counter() - start:.1f} s; "
        f"metrics in {out / METRICS_NAME}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
