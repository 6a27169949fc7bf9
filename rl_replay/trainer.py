"""The training loop: collect, loss, one backward, clip, step, log, checkpoint.

:func:`build` turns a config into a ready :class:`Trainer`, validating everything that
can be wrong (env id, agent path, action space, distributed setup) *before* the run
directory is created. :meth:`Trainer.train` is the thin loop.
"""

from __future__ import annotations

import collections
import math
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rl_replay import distributed as dist_utils
from rl_replay.agent import Agent, build_agent
from rl_replay.allocator import keep_freed_memory
from rl_replay.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint
from rl_replay.collector import Collector, make_vector_env
from rl_replay.config import Config, config_to_dict, derived, load_config, save_config
from rl_replay.logger import (METRICS_NAME, RunLogger, begin_update, truncate_metrics, update_memory,
                              wandb_preflight)
from rl_replay.losses import a2c_loss, reinforce_loss, total_loss

__all__ = ["Trainer", "build", "make_optimizer", "compute_loss"]


def make_optimizer(params, cfg) -> torch.optim.Optimizer:
    """Adam, RMSprop or SGD from an :class:`~rl_replay.config.OptimConfig`."""
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, eps=cfg.eps)
    if cfg.name == "rmsprop":
        return torch.optim.RMSprop(params, lr=cfg.lr, eps=cfg.eps, alpha=0.99)
    return torch.optim.SGD(params, lr=cfg.lr)


def compute_loss(data, cfg) -> Any:
    """The named loss terms of a rollout for a :class:`~rl_replay.config.LossConfig`."""
    if cfg.algorithm == "a2c":
        return a2c_loss(
            data, gamma=cfg.gamma, gae_lambda=cfg.gae_lambda, value_coef=cfg.value_coef,
            entropy_coef=cfg.entropy_coef, normalize_advantages=cfg.normalize_advantages,
        )
    return reinforce_loss(
        data, gamma=cfg.gamma, baseline=cfg.baseline, value_coef=cfg.value_coef,
        entropy_coef=cfg.entropy_coef, normalize_advantages=cfg.normalize_advantages,
    )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    """Owns one run: the collector, the (possibly FSDP-wrapped) agent and the optimizer."""

    def __init__(self, cfg: Config, *, run_dir: Path, collector: Collector, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, logger: RunLogger, info: dist_utils.DistInfo,
                 device: torch.device) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.collector = collector
        self.model = model
        self.optimizer = optimizer
        self.logger = logger
        self.info = info
        self.device = device
        self.update = 0
        self.env_steps = 0  # summed over all ranks
        # Every rank runs cfg.env.num_envs envs: an update consumes world_size times the batch.
        self.num_updates = math.ceil(cfg.total_env_steps / (derived(cfg)["batch_size"] * info.world_size))
        self.recent_returns: collections.deque[float] = collections.deque(maxlen=100)

    # ----------------------------------------------------------------- the loop
    def train(self) -> dict[str, float]:
        """Train until ``total_env_steps``; returns the last update's metrics."""
        metrics: dict[str, float] = {}
        try:
            while self.update < self.num_updates:
                metrics = self.step()
                if self.update % self.cfg.log.log_every == 0 or self.update == self.num_updates:
                    self.logger.log(metrics, update=self.update, env_steps=self.env_steps)
                every = self.cfg.checkpoint.every
                if (every and self.update % every == 0) or self.update == self.num_updates:
                    self.save()
        finally:
            self.logger.close()
        return metrics

    def step(self) -> dict[str, float]:
        """One update: collect a rollout, one backward through all its blocks, one step."""
        cfg = self.cfg
        if cfg.optim.anneal_lr:
            for group in self.optimizer.param_groups:
                group["lr"] = cfg.optim.lr * (1.0 - self.update / self.num_updates)
        begin_update(self.device)  # the memory metrics below are this update's, not the run's
        t0 = time.perf_counter()
        rollout = self.collector.collect()
        t1 = time.perf_counter()
        terms = compute_loss(rollout.data, cfg.loss)
        total_loss(terms).backward()  # replays every block, newest first
        t2 = time.perf_counter()
        grad_norm = self._clip()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        self.update += 1
        # Episode statistics are pooled over ranks (sums and counts, not means of means).
        pooled = dist_utils.reduce_sums({
            "steps": rollout.env_steps,
            "episodes": len(rollout.episode_returns),
            "return": sum(rollout.episode_returns),
            "length": sum(rollout.episode_lengths),
            "judged": len(rollout.episode_successes),
            "success": sum(rollout.episode_successes),
        }, self.device, self.info)
        steps = pooled["steps"]
        self.env_steps += int(steps)
        self.recent_returns.extend(rollout.episode_returns)
        acc = rollout.accumulator
        nan = float("nan")
        episodes, judged = pooled["episodes"], pooled["judged"]
        local = {
            "rollout/return_recent": float(np.mean(self.recent_returns)) if self.recent_returns else nan,
            "memory/replay_saved_bytes": float(acc.saved_bytes),
            "time/replay_backward_sec": t2 - t1,
            "time/replay_recompute_sec": acc.replay_seconds,
            "time/rollout_sec": t1 - t0,
            "time/update_sec": t3 - t0,
            **update_memory(self.device),
        }
        for key, value in terms.items():
            local["train/" + key] = float(value.detach())
        metrics = dist_utils.reduce_mean(local, self.device, self.info)
        metrics["rollout/episodes"] = episodes
        metrics["rollout/return_mean"] = pooled["return"] / episodes if episodes else nan
        metrics["rollout/episode_length"] = pooled["length"] / episodes if episodes else nan
        metrics["rollout/success_rate"] = pooled["success"] / judged if judged else nan
        metrics["train/grad_norm"] = float(grad_norm)
        metrics["train/lr"] = self.optimizer.param_groups[0]["lr"]
        metrics["time/steps_per_sec"] = steps / (t3 - t0)
        return metrics

    def _clip(self) -> torch.Tensor:
        max_norm = self.cfg.optim.max_grad_norm or float("inf")
        if hasattr(self.model, "clip_grad_norm_"):  # FSDP: the norm over all shards
            return self.model.clip_grad_norm_(max_norm)
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "update": self.update,
            "env_steps": self.env_steps,
            "agent": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "collector": self.collector.state_dict(),
            "rng": {
                "torch": torch.get_rng_state(),
                "numpy": np.random.get_state(),
                "python": random.getstate(),
            },
            "recent_returns": list(self.recent_returns),
            "wandb_id": self.logger.wandb_id,
            "config": config_to_dict(self.cfg),
        }

    def save(self) -> None:
        if self.info.distributed:
            from rl_replay.distributed_checkpoint import save_distributed

            save_distributed(self)
            self.logger.checkpointed(self.update)
            return
        save_checkpoint(self.state_dict(), checkpoint_path(self.run_dir))
        self.logger.checkpointed(self.update)  # wandb gets only rows a resume would not redo

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.update = state["update"]
        self.env_steps = state["env_steps"]
        self.model.load_state_dict(state["agent"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.collector.load_state_dict(state["collector"])
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        self.recent_returns.extend(state["recent_returns"])


def default_run_dir(cfg: Config) -> Path:
    name = cfg.log.run_name or f"{cfg.env.id.replace('/', '_')}-{time.strftime('%Y%m%d-%H%M%S')}"
    return Path("runs") / name


def build(cfg: Config | None = None, *, resume: str | Path | None = None,
          overrides: tuple[str, ...] = ()) -> Trainer:
    """Build a Trainer from a config, or resume the run in ``resume`` (its saved config).

    Everything that can be misconfigured is checked before the run directory exists.
    """
    state = None
    if resume is not None:
        resume = Path(resume)
        ckpt = checkpoint_path(resume)
        if not ckpt.exists():
            raise FileNotFoundError(f"cannot resume: no checkpoint at {ckpt}")
        cfg = load_config(resume / "config.yaml", overrides)
        cfg = replace(cfg, run_dir=str(resume))
    assert cfg is not None
    wandb_mode = wandb_preflight(cfg.log.wandb_mode)  # WANDB_MODE wins; online: is the server reachable?
    if cfg.torch_threads is not None:
        torch.set_num_threads(cfg.torch_threads)
    if cfg.keep_freed_memory:
        keep_freed_memory()
    info, device = dist_utils.init_from_env(cfg.device, cfg.distributed.backend)
    seed_everything(cfg.seed + 1000 * info.rank)
    envs = make_vector_env(
        cfg.env.id, cfg.env.num_envs, vectorization=cfg.env.vectorization,
        kwargs=cfg.env.kwargs, max_episode_steps=cfg.env.max_episode_steps,
        imports=cfg.env.imports, wrappers=cfg.env.wrappers,
    )
    try:
        agent: Agent = build_agent(cfg.agent.target, cfg.agent.kwargs, envs.single_observation_space,
                                   envs.single_action_space).to(device)
        num_params = sum(p.numel() for p in agent.parameters())  # before FSDP shards them
        model: torch.nn.Module = agent
        if info.distributed:
            d = cfg.distributed
            model = dist_utils.wrap_fsdp(agent, device, wrap_modules=d.wrap_modules,
                                         min_num_params=d.min_num_params, cpu_offload=d.cpu_offload,
                                         mixed_precision=d.mixed_precision)
        elif cfg.distributed.cpu_offload:
            from rl_replay.errors import SetupError

            raise SetupError("distributed.cpu_offload applies to FSDP runs under torchrun only.")
    except BaseException:
        envs.close()
        raise
    optimizer = make_optimizer(model.parameters(), cfg.optim)
    collector = Collector(envs, model, num_steps=cfg.collector.num_steps, mode=cfg.collector.mode,
                          bptt_truncate=cfg.collector.bptt_truncate, device=device,
                          seed=cfg.seed + 1000 * info.rank)
    # Nothing has been written yet; from here on the run exists on disk.
    run_dir = Path(cfg.run_dir) if cfg.run_dir else default_run_dir(cfg)
    if info.distributed:
        run_dir = Path(_broadcast_str(str(run_dir), info))
    if resume is not None:
        state = _load_resume_state(run_dir, info)
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg = replace(cfg, run_dir=str(run_dir))
        save_config(cfg, run_dir / "config.yaml")
        if state is not None:
            truncate_metrics(run_dir / METRICS_NAME, state["update"])
    dist_utils.barrier(info)
    logger = RunLogger(
        run_dir, config=config_to_dict(cfg), is_main=info.is_main, wandb_mode=wandb_mode,
        wandb_project=cfg.log.wandb_project, wandb_entity=cfg.log.wandb_entity,
        run_name=cfg.log.run_name or run_dir.name, wandb_id=state["wandb_id"] if state else None,
        group=cfg.log.group, tags=cfg.log.tags, extras=_run_extras(cfg, num_params, info, device),
        progress=cfg.log.progress, total_env_steps=cfg.total_env_steps,
        start_env_steps=state["env_steps"] if state else 0, start_update=state["update"] if state else 0,
    )
    trainer = Trainer(cfg, run_dir=run_dir, collector=collector, model=model, optimizer=optimizer,
                      logger=logger, info=info, device=device)
    if state is not None:
        if info.distributed:
            from rl_replay.distributed_checkpoint import load_distributed

            load_distributed(trainer, state)
        else:
            trainer.load_state_dict(state)
    return trainer


def _run_extras(cfg: Config, num_params: int, info: dist_utils.DistInfo, device: torch.device) -> dict:
    """Facts about the run that the config does not spell out (wandb config ``run``)."""
    per_rank = derived(cfg)["batch_size"]
    return {
        "num_params": num_params, "world_size": info.world_size, "device": str(device),
        "batch_size_per_rank": per_rank, "batch_size": per_rank * info.world_size,
        "num_updates": math.ceil(cfg.total_env_steps / (per_rank * info.world_size)),
    }


def _load_resume_state(run_dir: Path, info: dist_utils.DistInfo) -> dict[str, Any]:
    if info.distributed:
        from rl_replay.distributed_checkpoint import read_distributed

        return read_distributed(run_dir, info)
    state = load_checkpoint(checkpoint_path(run_dir))
    if state.get("world_size", 1) != 1:  # written by an FSDP run
        from rl_replay.distributed_checkpoint import check_world_size

        check_world_size(state, 1, checkpoint_path(run_dir))
    return state


def _broadcast_str(value: str, info: dist_utils.DistInfo) -> str:
    import torch.distributed as dist

    box = [value if info.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
