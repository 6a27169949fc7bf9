"""The training loop: one algorithm update (collect, optimise, guarded steps), log, checkpoint.

:class:`Trainer` is the loop and nothing else; :func:`rl_replay.run.setup.build` makes one from a
config (or resumes one), validating everything that can be wrong before anything is written.
"""

from __future__ import annotations

import collections
import contextlib
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rl_replay import distributed as dist_utils
from rl_replay import guards
from rl_replay.algorithms.base import Algorithm
from rl_replay.algorithms.schedules import RunProgress
from rl_replay.config import Config, batch_size_per_rank, num_updates
from rl_replay.errors import TrainingInterrupted
from rl_replay.rollout.collector import Collector
from rl_replay.run.interrupt import StopOnSignal
from rl_replay.run.logger import METRICS_NAME, RunLogger
from rl_replay.run.memory_stats import begin_update
from rl_replay.run.metrics import pool_update_metrics
from rl_replay.run.trainer_state import (
    Progress,
    RunPlace,
    load_trainer,
    restore_trainer_rng,
    save_trainer,
    trainer_state,
)
from rl_replay.rundir.checkpoint import checkpoint_path
from rl_replay.rundir.door import RunDirectory
from rl_replay.rundir.lock import RunLock, writing
from rl_replay.targets import OWN, Importer

__all__ = ["Trainer"]


class Trainer:
    """The loop of one run, built whole by :func:`rl_replay.run.setup.build` and never patched.

    The algorithm owns the collector, the (possibly FSDP-wrapped) agent and the optimizer
    (:attr:`collector`, :attr:`model` and :attr:`optimizer` are its); the trainer anneals the
    learning rate, calls :meth:`Algorithm.update`, logs, checkpoints and holds the run
    directory's lock (rank 0) until :meth:`close`. ``num_params`` is the agent's parameter count,
    taken before FSDP shards it; ``progress`` is where a resumed run continues from.
    """

    def __init__(
        self,
        cfg: Config,
        *,
        run_dir: Path,
        algorithm: Algorithm,
        logger: RunLogger,
        info: dist_utils.DistInfo,
        device: torch.device,
        num_params: int,
        lock: RunLock | None = None,
        progress: Progress | None = None,
        run_id: str | None = None,
        importer: Importer = OWN,
        directory: RunDirectory | None = None,
    ) -> None:
        progress = progress or Progress()
        self.cfg = cfg
        self.run_dir = run_dir
        self.run_id = run_id  # the run's identity, signed into its config.yaml; its env state is bound to it
        self.importer = importer  # what the run's config may import (its evaluations make envs again)
        self.directory = directory  # the run directory held open (rank 0: locked, written through)
        self.algorithm = algorithm
        self.logger = logger
        self.info = info
        self.device = device
        self.lock = lock
        self.num_params = num_params
        # Known in advance only in fixed mode; in episode mode an update takes as many steps
        # as its longest episode, so the run goes on until the step budget is reached.
        self.num_updates = num_updates(cfg, world_size=info.world_size) if cfg.collector.mode == "fixed" else None
        #: The trainer's own state (what a checkpoint holds besides the algorithm's).
        self.progress = progress

    @property
    def update(self) -> int:
        """Updates done so far."""
        return self.progress.update

    @property
    def env_steps(self) -> int:
        """Env steps taken so far, summed over all ranks."""
        return self.progress.env_steps

    @property
    def recent_returns(self) -> collections.deque[float]:
        """This rank's last episode returns (what ``train/return_mean`` averages)."""
        return self.progress.recent_returns

    @property
    def last_checkpoint(self) -> str | None:
        """``"PATH (update N)"`` of the last checkpoint written or loaded."""
        return self.progress.last_checkpoint

    @property
    def place(self) -> RunPlace:
        """Where this run's checkpoints are written, and for what (:func:`save_trainer`)."""
        assert self.directory is not None, "a trainer built by build() holds its run directory"
        return RunPlace(self.cfg, self.info, self.device, self.directory, self.run_id, self.logger.wandb_id)

    @property
    def collector(self) -> Collector:
        return self.algorithm.collector

    @property
    def model(self) -> torch.nn.Module:
        return self.algorithm.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.algorithm.optimizer

    @property
    def guard(self) -> guards.StepGuard:
        """The non-finite checks every optimizer step of the algorithm passes through."""
        assert self.algorithm.guard is not None
        return self.algorithm.guard

    # ----------------------------------------------------------------- the loop
    def train(self) -> dict[str, float]:
        """Train until ``total_env_steps`` are reached (see :attr:`finished`); returns the last update's metrics.

        On SIGINT, SIGTERM, SIGUSR1 or SIGUSR2 the current update is finished, a checkpoint written and
        :class:`~rl_replay.errors.TrainingInterrupted` raised. Non-finite values stop
        the run with :class:`~rl_replay.errors.NonFiniteError` (no checkpoint is written),
        a failed write into the run directory (disk full, read-only) with
        :class:`~rl_replay.errors.RunWriteError`.
        The logger and the run directory's lock are released in every case.
        """
        metrics: dict[str, float] = {}
        try:
            with StopOnSignal(announce=self.info.is_main) as signals:
                while not self.finished:
                    metrics = self.step()
                    if self.update % self.cfg.log.log_every == 0 or self.finished:
                        with self._writing(self.run_dir / METRICS_NAME):
                            self.logger.log(metrics, update=self.update, env_steps=self.env_steps)
                    every = self.cfg.checkpoint.every
                    saved = (every and self.update % every == 0) or self.finished
                    if saved:
                        self.save()
                    signum = signals.requested(self.info, self.device)
                    if signum and not self.finished:
                        if not saved:
                            self.save()
                        raise TrainingInterrupted(signum, self.update, self.last_checkpoint, str(self.run_dir))
        finally:
            self.close()
        return metrics

    @property
    def finished(self) -> bool:
        """Whether the run has taken its ``total_env_steps`` (over all ranks).

        In fixed mode that is after ``num_updates`` updates; in episode mode, whose updates
        are as long as their episodes, after however many updates reach the budget. The
        last update may overshoot it by less than one update's steps, never fall short.
        """
        return self.env_steps >= self.cfg.total_env_steps

    def budget_used(self) -> float:
        """The fraction of the run done before the next update, in [0, 1): the lr schedule's clock."""
        if self.num_updates is not None:
            # update / num_updates while the world size stays; counted in env steps, so a run
            # resumed on another number of ranks keeps its place on the clock.
            per_update = batch_size_per_rank(self.cfg) * self.info.world_size
            return min(self.env_steps / (self.num_updates * per_update), 1.0)
        return self.env_steps / self.cfg.total_env_steps

    def step(self) -> dict[str, float]:
        """One update of ``cfg.loss.algorithm`` (collect, then optimise), with its metrics."""
        cfg = self.cfg
        progress = RunProgress(self.update + 1, self.env_steps, self.budget_used(), self.last_checkpoint)
        begin_update(self.device)  # the memory metrics below are this update's, not the run's
        result = self.algorithm.update(progress)
        self.progress.update += 1
        self.progress.recent_returns.extend(result.rollout.episode_returns)
        metrics, steps = pool_update_metrics(
            result,
            recent_returns=self.recent_returns,
            lr=self.optimizer.param_groups[0]["lr"],
            skipped_updates=self.guard.budget.skipped,
            device=self.device,
            info=self.info,
        )
        self.progress.env_steps += steps
        metrics["run/world_size"] = float(self.info.world_size)  # where a resume changed it, the row says so
        if cfg.loss.entropy_schedule != "constant":
            metrics["train/entropy_coef"] = self.algorithm.entropy_coef
        every = cfg.log.horizon_every
        if every and self.update % every == 0:
            t0 = time.perf_counter()
            metrics.update(self.algorithm.horizon(result.rollout.data))
            metrics["time/horizon_sec"] = time.perf_counter() - t0
        every = cfg.eval.every
        if every and (self.update % every == 0 or self.finished):
            metrics.update(self.evaluate())
        return metrics

    def evaluate(self) -> dict[str, float]:
        """``eval.episodes`` episodes with the current weights on fresh envs: ``eval/*`` metrics.

        The same episodes every time (fixed env seed), so the curve shows the policy, not
        the draw. The training RNG streams are left as they were (a resumed run continues
        exactly), and so is the agent's training mode. One process only (refused under
        torchrun by :func:`build`): FSDP's forward is collective and episode lengths differ.
        """
        from rl_replay.rollout.env_state import pool_statistics, vector_statistics
        from rl_replay.run.evaluate import evaluate

        cfg = self.cfg
        t0 = time.perf_counter()
        np_state, py_state = np.random.get_state(), random.getstate()
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            result = evaluate(
                self.collector.policy.agent,
                cfg.env.id,
                episodes=cfg.eval.episodes,
                num_envs=min(cfg.eval.episodes, cfg.env.num_envs),
                deterministic=cfg.eval.deterministic,
                env_kwargs=cfg.env.kwargs,
                max_episode_steps=cfg.env.max_episode_steps,
                device=self.device,
                env_imports=cfg.env.imports,
                env_wrappers=cfg.env.wrappers,
                env_statistics=pool_statistics(vector_statistics(self.collector.envs)),
                env_observation_keys=cfg.env.observation_keys,
                vectorization=cfg.env.vectorization,
                importer=self.importer,
            )
        np.random.set_state(np_state)
        random.setstate(py_state)
        metrics = {f"eval/{key}": value for key, value in result.items() if key != "episodes"}
        metrics.setdefault("eval/success_rate", float("nan"))
        metrics["time/eval_sec"] = time.perf_counter() - t0
        return metrics

    # ----------------------------------------------------------------- checkpoints
    def save(self) -> None:
        """Write the checkpoint (collective under FSDP); refuses non-finite weights.

        A failed write (:class:`~rl_replay.errors.RunWriteError`) leaves the previous
        checkpoint in place.
        """
        with self._writing(checkpoint_path(self.run_dir)):
            path = save_trainer(self.algorithm, self.progress, self.place)
        self.progress.last_checkpoint = f"{path} (update {self.update})"
        with self._writing(self.run_dir):
            self.logger.checkpointed(self.update)  # wandb gets only rows a resume would not redo

    def _writing(self, path: Path) -> contextlib.AbstractContextManager[None]:
        """Turn the ``OSError`` of a write to ``path`` (ENOSPC, EROFS...) into one line naming it."""
        return writing(path, self.run_dir, self.last_checkpoint)

    def state_dict(self) -> dict[str, Any] | None:
        """The whole training state (agent, optimizer, collectors, RNG streams, counters, config).

        Call it on every rank: under FSDP it gathers, returns the state on the main process and
        ``None`` elsewhere. :meth:`save` writes it; :meth:`load_state_dict` takes it back.
        """
        return trainer_state(self.algorithm, self.progress, self.place)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` or a checkpoint (``read_trainer_state``), RNG streams included."""
        self.progress = load_trainer(self.algorithm, state, self.place)
        restore_trainer_rng(state, self.info, self.device)

    def close(self) -> None:
        """Close the logger (wandb, metrics file) and release the run directory."""
        self.logger.close()
        if self.lock is not None:
            self.lock.release()
        if self.directory is not None:
            self.directory.close()
