"""The training loop: one algorithm update (collect, optimise, guarded steps), log, checkpoint.

:func:`build` turns a config into a ready :class:`Trainer`, validating everything that
can be wrong (env id, agent path and contract, action space, distributed setup, a
resume's overrides against its checkpoint) *before* anything is written to the run
directory. :meth:`Trainer.train` is the thin loop.
"""

from __future__ import annotations

import collections
import contextlib
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rl_replay import distributed as dist_utils
from rl_replay import guards
from rl_replay.agent import Agent, build_agent, canonical_agent_target
from rl_replay.algorithms import make_algorithm
from rl_replay.engine import keep_freed_memory
from rl_replay.checkpoint import checkpoint_path, load_checkpoint, load_latest, remove_stale_temporaries
from rl_replay.collector import Collector
from rl_replay.config import (Config, batch_size_per_rank, config_to_dict, load_config, num_updates,
                              save_config)
from rl_replay.contract import check_agent
from rl_replay.environment import make_vector_env
from rl_replay.errors import CheckpointError, RunWriteError, SetupError, TrainingInterrupted
from rl_replay.horizon import episode_horizon
from rl_replay.interrupt import StopOnSignal, children_ignore_sigint
from rl_replay.logger import METRICS_NAME, RunLogger, truncate_metrics, unsent_wandb_id, wandb_preflight
from rl_replay.memory_stats import begin_update
from rl_replay.metrics import pool_update_metrics
from rl_replay.run_checkpoint import load_trainer, read_trainer_state, restore_trainer_rng, save_trainer
from rl_replay.run_dir import RunLock, claim_default, claim_fresh, default_name, logged_updates, resume_kind

__all__ = ["Trainer", "build", "make_optimizer", "RESUME_FIXED_KEYS"]


def make_optimizer(params, cfg) -> torch.optim.Optimizer:
    """Adam, RMSprop or SGD from an :class:`~rl_replay.config.OptimConfig`."""
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, eps=cfg.eps)
    if cfg.name == "rmsprop":
        return torch.optim.RMSprop(params, lr=cfg.lr, eps=cfg.eps, alpha=0.99)
    return torch.optim.SGD(params, lr=cfg.lr)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    """Owns one run: the collector, the (possibly FSDP-wrapped) agent and the optimizer.

    Training holds the run directory's lock (rank 0) until :meth:`close`. ``num_params`` is
    the agent's parameter count, taken before FSDP shards it.
    """

    def __init__(self, cfg: Config, *, run_dir: Path, collector: Collector, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, logger: RunLogger | None, info: dist_utils.DistInfo,
                 device: torch.device, num_params: int, lock: RunLock | None = None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.collector = collector
        self.model = model
        self.optimizer = optimizer
        self.logger = logger
        self.info = info
        self.device = device
        self.lock = lock
        self.update = 0
        self.env_steps = 0  # summed over all ranks
        # Known in advance only in fixed mode; in episode mode an update takes as many steps
        # as its longest episode, so the run goes on until the step budget is reached.
        self.num_updates = num_updates(cfg, world_size=info.world_size) if cfg.collector.mode == "fixed" else None
        self.recent_returns: collections.deque[float] = collections.deque(maxlen=100)
        self.last_checkpoint: str | None = None  # "PATH (update N)" of the last checkpoint written or loaded
        self.num_params = num_params
        # Every optimizer step of the algorithm passes through these non-finite checks.
        self.guard = guards.StepGuard(model, guards.SkipBudget(cfg.optim.skip_nonfinite_updates),
                                      any_rank=self._any_rank)
        self.algorithm = make_algorithm(cfg, collector, model, optimizer, info, device, guard=self.guard)

    # ----------------------------------------------------------------- the loop
    def train(self) -> dict[str, float]:
        """Train until ``total_env_steps`` are reached (see :attr:`finished`); returns the last update's metrics.

        On SIGINT / SIGTERM the current update is finished, a checkpoint written and
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
            return self.update / self.num_updates
        return self.env_steps / self.cfg.total_env_steps

    def step(self) -> dict[str, float]:
        """One update of ``cfg.loss.algorithm`` (collect, then optimise), with its metrics."""
        cfg = self.cfg
        if cfg.optim.anneal_lr:
            for group in self.optimizer.param_groups:
                group["lr"] = cfg.optim.lr * (1.0 - self.budget_used())
        self.guard.update, self.guard.last_checkpoint = self.update + 1, self.last_checkpoint
        begin_update(self.device)  # the memory metrics below are this update's, not the run's
        result = self.algorithm.update()
        self.update += 1
        self.recent_returns.extend(result.rollout.episode_returns)
        metrics, steps = pool_update_metrics(
            result, recent_returns=self.recent_returns, lr=self.optimizer.param_groups[0]["lr"],
            skipped_updates=self.guard.budget.skipped, device=self.device, info=self.info)
        self.env_steps += steps
        every = cfg.log.horizon_every
        if every and self.update % every == 0:
            t0 = time.perf_counter()
            metrics.update(episode_horizon(self.collector.agent, self.collector.policy, result.rollout.data,
                                           self.collector.bptt_truncate, block_steps=cfg.ppo.block_steps))
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
        from rl_replay.env_state import pool_statistics, vector_statistics
        from rl_replay.evaluate import evaluate

        cfg = self.cfg
        t0 = time.perf_counter()
        np_state, py_state = np.random.get_state(), random.getstate()
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            result = evaluate(
                self.collector.policy, cfg.env.id, episodes=cfg.eval.episodes,
                num_envs=min(cfg.eval.episodes, cfg.env.num_envs), deterministic=cfg.eval.deterministic,
                env_kwargs=cfg.env.kwargs, max_episode_steps=cfg.env.max_episode_steps, device=self.device,
                env_imports=cfg.env.imports, env_wrappers=cfg.env.wrappers,
                env_statistics=pool_statistics(vector_statistics(self.collector.envs)),
                env_observation_keys=cfg.env.observation_keys,
            )
        np.random.set_state(np_state)
        random.setstate(py_state)
        metrics = {f"eval/{key}": value for key, value in result.items() if key != "episodes"}
        metrics.setdefault("eval/success_rate", float("nan"))
        metrics["time/eval_sec"] = time.perf_counter() - t0
        return metrics

    def _any_rank(self, flag: bool) -> bool:
        """True if ``flag`` is set on some rank (an all-reduce under torchrun)."""
        return bool(dist_utils.reduce_sums({"bad": float(flag)}, self.device, self.info)["bad"])

    # ----------------------------------------------------------------- checkpoints
    def save(self) -> None:
        """Write the checkpoint (collective under FSDP); refuses non-finite weights.

        A failed write (:class:`~rl_replay.errors.RunWriteError`) leaves the previous
        checkpoint in place.
        """
        with self._writing(checkpoint_path(self.run_dir)):
            path = save_trainer(self)
        self.last_checkpoint = f"{path} (update {self.update})"
        with self._writing(self.run_dir):
            self.logger.checkpointed(self.update)  # wandb gets only rows a resume would not redo

    @contextlib.contextmanager
    def _writing(self, path: Path):
        """Turn the ``OSError`` of a write to ``path`` (ENOSPC, EROFS...) into one line naming it."""
        try:
            yield
        except OSError as exc:
            raise RunWriteError(exc, path, self.last_checkpoint, str(self.run_dir)) from None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint's state (from ``read_trainer_state``), RNG streams included."""
        load_trainer(self, state)
        restore_trainer_rng(self, state)

    def close(self) -> None:
        """Close the logger (wandb, metrics file) and release the run directory."""
        if self.logger is not None:
            self.logger.close()
        if self.lock is not None:
            self.lock.release()


# Keys a resume cannot change: the checkpoint's envs, agent and optimizer state are built
# for them (pickled envs would even silently replace the newly made ones).
RESUME_FIXED_KEYS = (
    "seed", "env.id", "env.num_envs", "env.vectorization", "env.kwargs", "env.max_episode_steps",
    "env.observation_keys", "agent.target", "agent.kwargs", "optim.name",
)


def _dotted(data: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data


def _check_resume_config(cfg: Config, saved: dict[str, Any], where: Path) -> None:
    now, defaults = config_to_dict(cfg), config_to_dict(Config())
    for key in RESUME_FIXED_KEYS:
        ours, theirs = _dotted(now, key), _dotted(saved, key)
        if theirs is None and _dotted(defaults, key) is not None:
            theirs = _dotted(defaults, key)  # a checkpoint written before the key existed
        if key == "agent.target":  # 'gru' and an older run's 'agents.gru:GRUAgent' are one class
            ours, theirs = canonical_agent_target(ours), canonical_agent_target(theirs)
        if ours != theirs:
            raise SetupError(
                f"cannot resume {where} with {key}={_dotted(now, key)!r}: its checkpoint was written with "
                f"{key}={_dotted(saved, key)!r}, and a resumed run keeps its environments, agent and "
                f"optimizer. Resume without that override, or start a new run (another run_dir) to change it."
            )


def _on_main(fn, info: dist_utils.DistInfo):
    """Run ``fn`` on rank 0 only and return its result there (None on other ranks).

    A SetupError it raises is raised on every rank, so no rank waits for a failed peer.
    """
    result, error = None, None
    if info.is_main:
        try:
            result = fn()
        except SetupError as exc:
            if not info.distributed:
                raise
            error = str(exc)
    if info.distributed:
        error = _broadcast_obj(error, info)
        if error is not None:
            raise SetupError(error)
    return result


def build(cfg: Config | None = None, *, resume: str | Path | None = None,
          overrides: tuple[str, ...] = (), trust_env_state: bool = False) -> Trainer:
    """Build a Trainer from a config, or resume the run in ``resume`` (its saved config).

    Everything that can be misconfigured is checked before anything is written: a fresh
    run's directory does not exist yet (or is empty); a resumed run's checkpoint is loaded
    into the new objects before its ``config.yaml`` is rewritten; one that stopped before its
    first checkpoint restarts in place from update 0 (a warning says how many logged updates
    that redoes). A failure releases what was taken until then (the run directory's lock, the
    envs, the logger); the returned trainer holds them until :meth:`Trainer.close`.

    A resume unpickles the checkpoint's environment state only if this user's MAC verifies it
    (:mod:`rl_replay.trust`), or with ``trust_env_state``; otherwise it starts fresh episodes
    and says why.
    """
    restart = False
    if resume is not None:
        resume = Path(resume)
        restart = resume_kind(resume) == "restart"
        cfg = _resume_config(resume, overrides)
    assert cfg is not None
    wandb_mode = wandb_preflight(cfg.log.wandb_mode)  # WANDB_MODE wins; online: is the server reachable?
    if cfg.torch_threads is not None:
        torch.set_num_threads(cfg.torch_threads)
    if cfg.keep_freed_memory:
        keep_freed_memory()
    info, device = dist_utils.init_from_env(cfg.device, cfg.distributed.backend)
    # Unwound (newest first) only if building fails: pop_all() hands everything to the trainer.
    with contextlib.ExitStack() as cleanup:
        lock: RunLock | None = None
        state, ckpt = None, None
        if resume is not None:
            # Refuse a run that is still being written before reading anything.
            lock = _hold(cleanup, _on_main(lambda: RunLock(resume), info))
            if not restart:
                state, ckpt = _read_resume_state(cfg, resume, info, trust_env_state)
        # A warm start's weights are read before anything is built or written: a bad path fails first.
        init_weights = _read_init_weights(cfg.init_from) if resume is None and cfg.init_from else None
        trainer = _build_objects(cfg, info, device, lock, cleanup, init_weights=init_weights)
        if state is not None:
            _load_resume_state(trainer, state, ckpt, resume)
        # Nothing has been written yet; from here on the run exists on disk.
        if resume is None:
            trainer.lock = lock = _hold(cleanup, _on_main(lambda: _claim_new(cfg), info))
            trainer.run_dir = Path(_broadcast_obj(str(lock.run_dir) if lock else None, info))
        elif restart and info.is_main:
            print(f"warning: {resume} has no checkpoint: the run stopped before its first one "
                  f"({logged_updates(resume)}); restarting it there from update 0 with its config.yaml.",
                  file=sys.stderr, flush=True)
        trainer.cfg = replace(cfg, run_dir=str(trainer.run_dir))
        cut_to = state["update"] if state is not None else 0 if restart else None
        wandb_id = state["wandb_id"] if state is not None else unsent_wandb_id(resume) if restart else None
        with trainer._writing(trainer.run_dir):
            _write_run_dir(trainer.cfg, trainer.run_dir, cut_to, info)
            trainer.logger = _open_logger(trainer, state, wandb_mode, wandb_id)
        cleanup.callback(trainer.logger.close)
        if state is not None:
            restore_trainer_rng(trainer, state)  # last: nothing after it draws random numbers
        cleanup.pop_all()
    return trainer


def _resume_config(resume: Path, overrides: tuple[str, ...]) -> Config:
    """The saved config of the run in ``resume`` with ``overrides``."""
    cfg = load_config(resume / "config.yaml", overrides)
    return replace(cfg, run_dir=str(resume))


def _hold(cleanup: contextlib.ExitStack, lock: RunLock | None) -> RunLock | None:
    """Have ``cleanup`` release ``lock`` (None on ranks other than 0) if building fails."""
    if lock is not None:
        cleanup.callback(lock.release)
    return lock


def _read_resume_state(cfg: Config, resume: Path, info: dist_utils.DistInfo,
                       trust_env_state: bool = False) -> tuple[dict[str, Any], Path]:
    """The checkpoint state to resume from and its path; refuses overrides it cannot honour."""
    state, ckpt, warning = read_trainer_state(resume, info, trust_env_state=trust_env_state)
    if warning and info.is_main:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    _check_resume_config(cfg, state["config"], resume)
    return state, ckpt


def _load_resume_state(trainer: Trainer, state: dict[str, Any], ckpt: Path, resume: Path) -> None:
    """Load the checkpoint into the newly built objects (RNG streams come last, in build)."""
    try:
        load_trainer(trainer, state)
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SetupError(
            f"cannot resume {resume}: its checkpoint {ckpt} does not fit the run as configured "
            f"({type(exc).__name__}: {first}). Resume without overrides that change the agent, "
            "optimizer or environments, or start a new run."
        ) from None
    trainer.last_checkpoint = f"{ckpt} (update {state['update']})"


def _write_run_dir(cfg: Config, run_dir: Path, cut_to: int | None, info: dist_utils.DistInfo) -> None:
    """Rank 0 writes ``config.yaml``; a resume first cuts ``metrics.jsonl`` back to update
    ``cut_to`` (its checkpoint's, or 0 for a restart) and removes stale temporary files."""
    if info.is_main:
        if cut_to is not None:
            remove_stale_temporaries(run_dir)
            truncate_metrics(run_dir / METRICS_NAME, cut_to)
        save_config(cfg, run_dir / "config.yaml")
    dist_utils.barrier(info)


def _open_logger(trainer: Trainer, state: dict[str, Any] | None, wandb_mode: str,
                 wandb_id: str | None) -> RunLogger:
    """The run's logger, continuing a resumed run's wandb run (``wandb_id``) and progress."""
    cfg, info = trainer.cfg, trainer.info
    return RunLogger(
        trainer.run_dir, config=config_to_dict(cfg), is_main=info.is_main, wandb_mode=wandb_mode,
        wandb_project=cfg.log.wandb_project, wandb_entity=cfg.log.wandb_entity,
        run_name=cfg.log.run_name or trainer.run_dir.name, wandb_id=wandb_id,
        group=cfg.log.group, tags=cfg.log.tags,
        extras=_run_extras(cfg, trainer.num_params, info, trainer.device),
        progress=cfg.log.progress, total_env_steps=cfg.total_env_steps,
        start_env_steps=state["env_steps"] if state else 0,
        start_update=state["update"] if state else 0,
    )


def _read_init_weights(source: str) -> dict[str, torch.Tensor]:
    """The agent state dict of the checkpoint ``init_from`` names (a run directory or a file)."""
    path = Path(source)
    try:
        if path.is_dir():
            state, _, warning = load_latest(path)
            if warning:
                print(f"warning: init_from={source!r}: {warning}", file=sys.stderr, flush=True)
        else:
            state = load_checkpoint(path)
    except FileNotFoundError:
        raise SetupError(f"init_from={source!r}: no checkpoint there. Give a run directory that holds "
                         "checkpoint.pt, or the path of a checkpoint file.") from None
    except CheckpointError as exc:
        raise SetupError(f"init_from={source!r}: {exc}") from None
    return state["agent"]


def _load_init_weights(agent: torch.nn.Module, weights: dict[str, torch.Tensor], source: str) -> None:
    """Copy a warm start's weights into the freshly built (still unwrapped) agent."""
    try:
        agent.load_state_dict(weights)
    except RuntimeError as exc:
        detail = " ".join(line.strip() for line in str(exc).strip().splitlines()[:3])
        raise SetupError(
            f"init_from={source!r}: its agent does not fit this run's agent ({detail}). A warm start "
            "needs the same agent.target and agent.kwargs and the same observation and action spaces."
        ) from None


def _build_objects(cfg: Config, info: dist_utils.DistInfo, device: torch.device,
                   lock: RunLock | None, cleanup: contextlib.ExitStack,
                   init_weights: dict[str, torch.Tensor] | None = None) -> Trainer:
    """Envs, agent (checked against the Agent contract), optimizer, collector: nothing on disk.

    ``init_weights`` (a warm start, ``cfg.init_from``) are loaded into the agent before FSDP
    wraps it. The envs are closed by ``cleanup`` if building fails.
    """
    seed_everything(cfg.seed + 1000 * info.rank)
    with children_ignore_sigint():  # Ctrl-C is the trainer's to handle, not the env workers'
        envs = make_vector_env(
            cfg.env.id, cfg.env.num_envs, vectorization=cfg.env.vectorization,
            kwargs=cfg.env.kwargs, max_episode_steps=cfg.env.max_episode_steps,
            imports=cfg.env.imports, wrappers=cfg.env.wrappers, observation_keys=cfg.env.observation_keys,
        )
    cleanup.callback(envs.close)
    agent: Agent = build_agent(cfg.agent.target, cfg.agent.kwargs, envs.single_observation_space,
                               envs.single_action_space).to(device)
    if init_weights is not None:
        _load_init_weights(agent, init_weights, cfg.init_from)
    num_params = sum(p.numel() for p in agent.parameters())  # before FSDP shards them
    model: torch.nn.Module = agent
    if info.distributed:
        d = cfg.distributed
        model = dist_utils.wrap_fsdp(agent, device, wrap_modules=d.wrap_modules,
                                     min_num_params=d.min_num_params, cpu_offload=d.cpu_offload,
                                     mixed_precision=d.mixed_precision)
    elif cfg.distributed.cpu_offload:
        raise SetupError("distributed.cpu_offload applies to FSDP runs under torchrun only.")
    if info.distributed and cfg.eval.every:
        raise SetupError(
            "eval.every is not supported under torchrun (FSDP's forward is collective and "
            "evaluation episodes end at different steps on different ranks). Set eval.every=0 "
            "and evaluate the checkpoint with: python scripts/evaluate.py RUN_DIR")
    if info.distributed and cfg.log.horizon_every:
        raise SetupError(
            "log.horizon_every is not supported under torchrun (it replays one rank's episode, "
            "and FSDP's forward is collective). Set log.horizon_every=0 and measure a checkpoint "
            "with: python scripts/grad_horizon.py --run RUN_DIR")
    optimizer = make_optimizer(model.parameters(), cfg.optim)
    reduce_sums = None
    if info.distributed:
        def reduce_sums(values: dict[str, float]) -> dict[str, float]:
            return dist_utils.reduce_sums(values, device, info)
    collector = Collector(envs, model, num_steps=cfg.collector.num_steps, mode=cfg.collector.mode,
                          bptt_truncate=cfg.collector.bptt_truncate, device=device,
                          seed=cfg.seed + 1000 * info.rank, reduce_sums=reduce_sums)
    check_agent(model, collector.policy, collector.probe_inputs(), envs.single_action_space,
                cfg.agent.target)
    run_dir = Path(cfg.run_dir) if cfg.run_dir else None
    return Trainer(cfg, run_dir=run_dir, collector=collector, model=model, optimizer=optimizer,
                   logger=None, info=info, device=device, num_params=num_params, lock=lock)


def _claim_new(cfg: Config) -> RunLock:
    """Create and lock a fresh run directory (refusing one that holds another run)."""
    if cfg.run_dir:
        return claim_fresh(cfg.run_dir)
    _, lock = claim_default("runs", cfg.log.run_name or default_name(cfg.env.id))
    return lock


def _run_extras(cfg: Config, num_params: int, info: dist_utils.DistInfo, device: torch.device) -> dict:
    """Facts about the run that the config does not spell out (wandb config ``run``)."""
    per_rank = batch_size_per_rank(cfg)
    return {
        "num_params": num_params, "world_size": info.world_size, "device": str(device),
        "batch_size_per_rank": per_rank, "batch_size": per_rank * info.world_size,
        # None in episode mode: the number of updates depends on the episodes' lengths.
        "num_updates": num_updates(cfg, world_size=info.world_size) if cfg.collector.mode == "fixed" else None,
    }


def _broadcast_obj(value: Any, info: dist_utils.DistInfo) -> Any:
    if not info.distributed:
        return value
    import torch.distributed as dist

    box = [value if info.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
