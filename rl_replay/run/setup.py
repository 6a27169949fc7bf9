"""Setting up a run: a config (or a run directory to resume, or a warm start) into a ready
:class:`~rl_replay.run.trainer.Trainer`.

:func:`build` validates everything that can be wrong (env id, agent path and contract, action
space, distributed setup, a resume's overrides against its checkpoint) *before* anything is
written to the run directory.
"""

from __future__ import annotations

import contextlib
import functools
import random
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rl_replay import distributed as dist_utils
from rl_replay import guards
from rl_replay.agent import Agent, build_agent, canonical_agent_target
from rl_replay.algorithms import make_algorithm
from rl_replay.algorithms.base import Algorithm
from rl_replay.config import Config, batch_size_per_rank, config_to_dict, num_updates
from rl_replay.contract import check_agent
from rl_replay.engine import keep_freed_memory
from rl_replay.errors import RunDirError, SetupError, one_line, shown
from rl_replay.gathered import collection_plan
from rl_replay.rollout.collector import Collector
from rl_replay.rollout.environment import envs_from_config
from rl_replay.run.interrupt import children_ignore_sigint
from rl_replay.run.logger import (
    RunLogger,
    tensorboard_preflight,
    truncate_metrics,
    unsent_wandb_id,
    wandb_preflight,
)
from rl_replay.run.trainer import Trainer
from rl_replay.run.trainer_state import (
    Progress,
    RunPlace,
    check_rng,
    load_trainer,
    read_trainer_state,
    restore_trainer_rng,
    version_change,
    world_change,
)
from rl_replay.rundir import trust
from rl_replay.rundir.checkpoint import (
    finite_weights,
    load_checkpoint,
    remove_stale_temporaries,
    stale_temporaries,
)
from rl_replay.rundir.config_file import new_run_id, write_run_config
from rl_replay.rundir.door import RunDirectory, Trust
from rl_replay.rundir.env_state_file import env_binding
from rl_replay.rundir.files import Dir
from rl_replay.rundir.footprint import check_fits
from rl_replay.rundir.lock import (
    default_name,
    logged_updates,
    writing,
)
from rl_replay.targets import OWN, Importer

__all__ = ["build", "make_optimizer", "seed_everything", "RESUME_FIXED_KEYS"]


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


# Keys a resume cannot change: the checkpoint's envs, agent and optimizer state are built
# for them (pickled envs would even silently replace the newly made ones).
RESUME_FIXED_KEYS = (
    "seed",
    "env.id",
    "env.num_envs",
    "env.vectorization",
    "env.kwargs",
    "env.max_episode_steps",
    "env.observation_keys",
    "agent.target",
    "agent.kwargs",
    "optim.name",
)


def _dotted(data: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        data = data.get(part) if isinstance(data, dict) else None  # type: ignore[assignment]
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
                f"cannot resume {where} with {key}={shown(_dotted(now, key))}: its checkpoint was written with "
                f"{key}={shown(_dotted(saved, key))}, and a resumed run keeps its environments, agent and "
                f"optimizer. Resume without that override, or start a new run (another run_dir) to change it."
            )


def build(
    cfg: Config | None = None,
    *,
    resume: str | Path | None = None,
    overrides: tuple[str, ...] = (),
    trust_env_state: bool = False,
    trust_config: bool = False,
) -> Trainer:
    """Build a Trainer from a config, or resume the run in ``resume`` (its saved config).

    Everything that can be misconfigured is checked before anything is written: a fresh
    run's directory does not exist yet (or is empty); a resumed run's checkpoint, RNG states,
    wrapper statistics and metrics rows are read, checked and loaded into the new objects
    before its ``config.yaml`` is rewritten or its ``metrics.jsonl`` cut back, so a refused
    resume leaves the run's files as they were. One that stopped before its first checkpoint
    restarts in place from update 0 (a warning says how many logged updates that redoes). A
    failure releases what was taken until then (the run directory's lock, the envs, the
    logger); the returned trainer holds them until :meth:`Trainer.close`.

    A resumed run's ``config.yaml`` imports modules outside rl_replay and gymnasium only if
    this user's signature verifies it, or with ``trust_config``
    (:mod:`rl_replay.rundir.config_file`). Its environment state is unpickled only if this user's
    MAC verifies it (:mod:`rl_replay.rundir.trust`), or with ``trust_env_state``; otherwise it
    starts fresh episodes and says why.
    """
    # The key that signs what this run writes, checked (and made) before anything is written.
    trust.user_secret()
    if resume is None:
        assert cfg is not None
        return _build(cfg, None, False, OWN, None)
    # Every rank opens the run (each reads its checkpoint); rank 0 alone takes its lock, in _build.
    try:
        directory = RunDirectory.open(resume, trust=Trust(config=trust_config, env_state=trust_env_state))
    except FileNotFoundError:
        raise RunDirError(
            f"cannot resume {resume}: no such directory. Start a new run there with run_dir={resume}"
        ) from None
    try:
        restart = directory.resume_kind() == "restart"
        run_config = directory.config(overrides)
        cfg = replace(run_config.cfg, run_dir=str(resume))
        return _build(cfg, directory, restart, directory.importer(run_config), run_config.run_id)
    except BaseException:
        directory.close()
        raise


def _build(
    cfg: Config, directory: RunDirectory | None, restart: bool, importer: Importer, run_id: str | None
) -> Trainer:
    """``build`` once the config is known. ``directory`` is a resumed run's, held open (None: a new
    run); ``importer`` is what its config may import; ``run_id`` is its identity as its signed
    config names it (None: a new run, or a config that names none, which gets a new one)."""
    wandb_mode = wandb_preflight(cfg.log.wandb_mode)  # WANDB_MODE wins; online: is the server reachable?
    tensorboard_preflight(cfg.log.tensorboard)  # installed?
    if cfg.torch_threads is not None:
        torch.set_num_threads(cfg.torch_threads)
    if cfg.keep_freed_memory:
        keep_freed_memory()
    info, device = dist_utils.init_from_env(cfg.device, cfg.distributed.backend)
    if info.distributed:
        check_distributed_config(cfg)
    # Unwound (newest first) only if building fails: pop_all() hands everything to the trainer.
    with contextlib.ExitStack() as cleanup:
        state, ckpt = None, None
        if directory is not None:
            # Refuse a run that is still being written before reading anything; the pid is
            # written into the lock once everything read has been checked.
            resumed = directory
            dist_utils.on_main(resumed.take_lock, info)
            dist_utils.on_main(lambda: _check_untouched(resumed), info)
            if not restart:
                binding = env_binding(cfg.env, run_id)
                state, ckpt = _read_resume_state(cfg, directory, info, device, binding)
        # A warm start's weights are read before anything is built or written: a bad path fails first.
        init_weights = _read_init_weights(cfg.init_from) if directory is None and cfg.init_from else None
        algorithm, num_params = _build_objects(cfg, info, device, cleanup, init_weights=init_weights, importer=importer)
        progress = Progress()
        if state is not None:
            assert directory is not None and ckpt is not None  # a state is read from a run directory
            progress = _load_resume_state(algorithm, state, ckpt, RunPlace(cfg, info, device, directory))
        # Nothing has been written yet; from here on the run exists on disk.
        if directory is None:
            directory = dist_utils.on_main(lambda: _claim_new(cfg), info)
            run_dir = Path(dist_utils.broadcast_from_main(str(directory.path) if directory else None, info))
            if directory is None:  # the other ranks: they write their checkpoint shards into it
                directory = RunDirectory.open(run_dir)
        else:
            run_dir = directory.path
            dist_utils.on_main(directory.record_pid, info)
            if restart and info.is_main:
                print(
                    f"warning: {run_dir} has no checkpoint: the run stopped before its first one "
                    f"({logged_updates(directory.dir)}); restarting it there from update 0 with its config.yaml.",
                    file=sys.stderr,
                    flush=True,
                )
        if directory is not None:
            cleanup.callback(directory.close)
        cfg = replace(cfg, run_dir=str(run_dir))
        run_id = run_id or dist_utils.broadcast_from_main(new_run_id() if info.is_main else None, info)
        cut_to = state["update"] if state is not None else 0 if restart else None
        wandb_id = (
            state["wandb_id"]
            if state is not None
            else unsent_wandb_id(directory.dir)
            if restart and directory
            else None
        )
        with writing(run_dir, run_dir, progress.last_checkpoint):
            _write_run_dir(cfg, directory, cut_to, info, run_id)
            where = directory.dir if directory is not None else run_dir
            logger = _open_logger(cfg, where, info, device, num_params, progress, wandb_mode, wandb_id)
        cleanup.callback(logger.close)
        trainer = Trainer(
            cfg,
            run_dir=run_dir,
            algorithm=algorithm,
            logger=logger,
            info=info,
            device=device,
            num_params=num_params,
            lock=directory.lock if directory is not None else None,
            progress=progress,
            run_id=run_id,
            importer=importer,
            directory=directory,
        )
        if state is not None:
            restore_trainer_rng(state, info, device)  # last: nothing after it draws random numbers
        cleanup.pop_all()
    return trainer


def _check_untouched(directory: RunDirectory) -> None:
    """Read what a resume will rewrite before it changes anything: every row of ``metrics.jsonl``
    (one that is not a row is refused now) and the stale temporaries it will remove (one that is
    not a file is refused by name)."""
    directory.metrics()
    stale_temporaries(directory.dir)


def _read_resume_state(
    cfg: Config,
    directory: RunDirectory,
    info: dist_utils.DistInfo,
    device: torch.device,
    binding: bytes,
) -> tuple[dict[str, Any], Path]:
    """The checkpoint state to resume from and its path; refuses overrides it cannot honour
    and RNG states that cannot be restored."""
    resume = directory.path
    state, ckpt, warning = read_trainer_state(directory, info, binding)
    if warning and info.is_main:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    _check_resume_config(cfg, state["config"], resume)
    try:
        if info.rank < state["world_size"]:  # a rank past the writer's has no saved streams
            check_rng(state["rng"][info.rank], device)
    except ValueError as exc:
        raise SetupError(f"cannot resume {resume}: its checkpoint {ckpt} holds {exc}.") from None
    for change in (
        world_change(state, info.world_size, resume),
        version_change(state, cfg.distributed.fsdp_version, info.distributed, resume),
    ):
        if change and info.is_main:
            print(change, flush=True)
    return state, ckpt


def _load_resume_state(algorithm: Algorithm, state: dict[str, Any], ckpt: Path, place: RunPlace) -> Progress:
    """Load the checkpoint into the newly built objects (RNG streams come last, in build)."""
    resume = place.directory.path
    try:
        progress = load_trainer(algorithm, state, place)
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SetupError(
            f"cannot resume {resume}: its checkpoint {ckpt} does not fit the run as configured "
            f"({type(exc).__name__}: {first}). Resume without overrides that change the agent, "
            "optimizer or environments, or start a new run."
        ) from None
    progress.last_checkpoint = f"{ckpt} (update {state['update']})"
    return progress


def _write_run_dir(
    cfg: Config, directory: RunDirectory | None, cut_to: int | None, info: dist_utils.DistInfo, run_id: str
) -> None:
    """Rank 0 writes ``config.yaml``; a resume first cuts ``metrics.jsonl`` back to update
    ``cut_to`` (its checkpoint's, or 0 for a restart) and removes stale temporary files."""
    if info.is_main:
        assert directory is not None
        if cut_to is not None:
            remove_stale_temporaries(directory.dir)
            truncate_metrics(directory.dir, cut_to)
        write_run_config(cfg, directory.dir, trust.user_secret(), run_id)
    dist_utils.barrier(info)


def _open_logger(
    cfg: Config,
    run_dir: Dir | Path,
    info: dist_utils.DistInfo,
    device: torch.device,
    num_params: int,
    progress: Progress,
    wandb_mode: str,
    wandb_id: str | None,
) -> RunLogger:
    """The run's logger, continuing a resumed run's wandb run (``wandb_id``) and progress."""
    return RunLogger(
        run_dir,
        config=config_to_dict(cfg),
        is_main=info.is_main,
        wandb_mode=wandb_mode,
        wandb_project=cfg.log.wandb_project,
        wandb_entity=cfg.log.wandb_entity,
        run_name=cfg.log.run_name or Path(cfg.run_dir or ".").name,
        wandb_id=wandb_id,
        group=cfg.log.group,
        tags=cfg.log.tags,
        extras=_run_extras(cfg, num_params, info, device),
        progress=cfg.log.progress,
        progress_every=cfg.log.progress_every,
        total_env_steps=cfg.total_env_steps,
        start_env_steps=progress.env_steps,
        start_update=progress.update,
        tensorboard=cfg.log.tensorboard,
    )


def _read_init_weights(source: str) -> dict[str, torch.Tensor]:
    """The agent state dict of the checkpoint ``init_from`` names (a run directory, through its
    door, or a checkpoint file the user named), its weights checked finite."""
    path = Path(source)
    try:
        if path.is_dir():
            with RunDirectory.open(path) as run:
                state, ckpt, warning = run.latest()
                if warning:
                    print(f"warning: init_from={shown(source)}: {one_line(warning)}", file=sys.stderr, flush=True)
                return run.weights(state, ckpt)
        return finite_weights(load_checkpoint(path, follow=True), path)  # a file the user named
    except FileNotFoundError:
        raise SetupError(
            f"init_from={shown(source)}: no checkpoint there. Give a run directory that holds "
            "checkpoint.pt, or the path of a checkpoint file."
        ) from None
    except SetupError as exc:  # a damaged or legacy checkpoint, a file that is not a regular one
        raise SetupError(f"init_from={shown(source)}: {exc}") from None


def _load_init_weights(agent: torch.nn.Module, weights: dict[str, torch.Tensor], source: str) -> None:
    """Copy a warm start's weights into the freshly built (still unwrapped) agent."""
    try:
        agent.load_state_dict(weights)
    except RuntimeError as exc:
        detail = " ".join(line.strip() for line in str(exc).strip().splitlines()[:3])
        raise SetupError(
            f"init_from={shown(source)}: its agent does not fit this run's agent ({detail}). A warm start "
            "needs the same agent.target and agent.kwargs and the same observation and action spaces."
        ) from None


def check_distributed_config(cfg: Config) -> None:
    """Refuse settings a torchrun (FSDP) run cannot honour, before anything is built."""
    if cfg.eval.every:
        raise SetupError(
            "eval.every is not supported under torchrun (FSDP's forward is collective and "
            "evaluation episodes end at different steps on different ranks). Set eval.every=0 "
            "and evaluate the checkpoint with: python scripts/evaluate.py RUN_DIR"
        )
    if cfg.log.horizon_every:
        raise SetupError(
            "log.horizon_every is not supported under torchrun (it replays one rank's episode, "
            "and FSDP's forward is collective). Set log.horizon_every=0 and measure a checkpoint "
            "with: python scripts/grad_horizon.py --run RUN_DIR"
        )


def _build_objects(
    cfg: Config,
    info: dist_utils.DistInfo,
    device: torch.device,
    cleanup: contextlib.ExitStack,
    init_weights: dict[str, torch.Tensor] | None = None,
    importer: Importer = OWN,
) -> tuple[Algorithm, int]:
    """Envs, agent (checked against the Agent contract), optimizer, collector, the non-finite
    guard and the algorithm that owns them, with the agent's parameter count: nothing on disk.

    ``init_weights`` (a warm start, ``cfg.init_from``) are loaded into the agent before FSDP
    wraps it. The envs are closed by ``cleanup`` if building fails. Everything the config names
    is imported through ``importer``.
    """
    seed_everything(cfg.seed + 1000 * info.rank)
    with children_ignore_sigint():  # Ctrl-C is the trainer's to handle, not the env workers'
        envs = envs_from_config(cfg.env, vectorization=cfg.env.vectorization, importer=importer)
    cleanup.callback(envs.close)
    check_fits(cfg, envs.single_observation_space, envs.single_action_space, importer=importer)
    agent: Agent = build_agent(
        cfg.agent.target, cfg.agent.kwargs, envs.single_observation_space, envs.single_action_space, importer
    ).to(device)
    if init_weights is not None:
        _load_init_weights(agent, init_weights, cfg.init_from)  # type: ignore[arg-type]
    num_params = sum(p.numel() for p in agent.parameters())  # before FSDP shards them
    model: torch.nn.Module = agent
    if info.distributed:
        d = cfg.distributed
        wrap = dist_utils.wrap_fsdp2 if d.fsdp_version == 2 else dist_utils.wrap_fsdp
        model = wrap(
            agent,
            device,
            wrap_modules=d.wrap_modules,
            min_num_params=d.min_num_params,
            cpu_offload=d.cpu_offload,
            mixed_precision=d.mixed_precision,
            sharding_strategy=d.sharding_strategy,
        )
    elif cfg.distributed.cpu_offload:
        raise SetupError("distributed.cpu_offload applies to FSDP runs under torchrun only.")
    optimizer = make_optimizer(model.parameters(), cfg.optim)
    reduce_sums = None
    if info.distributed:

        def reduce_sums(values: dict[str, float]) -> dict[str, float]:
            return dist_utils.reduce_sums(values, device, info)

    gather_once = False
    if info.distributed:
        d = cfg.distributed
        plan = collection_plan(
            model,
            d.collect_gathered,
            device=device,
            mixed_precision=d.mixed_precision,
            cpu_offload=d.cpu_offload,
            agree=lambda ok: not dist_utils.any_rank(not ok, device, info),
        )
        gather_once = plan.gathered
        if info.is_main:
            print(f"fsdp: {dist_utils.sharding_line(d.sharding_strategy, info, d.fsdp_version)}", flush=True)
            print(plan.line, flush=True)
    collector = Collector(
        envs,
        model,
        num_steps=cfg.collector.num_steps,
        mode=cfg.collector.mode,
        bptt_truncate=cfg.collector.bptt_truncate,
        device=device,
        seed=cfg.seed + 1000 * info.rank,
        reduce_sums=reduce_sums,
        gather_once=gather_once,
    )
    check_agent(model, collector.policy.agent, collector.probe_inputs(), envs.single_action_space, cfg.agent.target)
    # Every optimizer step of the algorithm passes through these non-finite checks.
    guard = guards.StepGuard(
        model,
        guards.SkipBudget(cfg.optim.skip_nonfinite_updates),
        any_rank=functools.partial(dist_utils.any_rank, device=device, info=info),
    )
    return make_algorithm(cfg, collector, model, optimizer, info, device, guard=guard), num_params


def _claim_new(cfg: Config) -> RunDirectory:
    """Create and lock a fresh run directory (refusing one that holds another run)."""
    return RunDirectory.create(cfg.run_dir or None, name=cfg.log.run_name or default_name(cfg.env.id))


def _run_extras(cfg: Config, num_params: int, info: dist_utils.DistInfo, device: torch.device) -> dict:
    """Facts about the run that the config does not spell out (wandb config ``run``)."""
    per_rank = batch_size_per_rank(cfg)
    return {
        "num_params": num_params,
        "world_size": info.world_size,
        "device": str(device),
        "batch_size_per_rank": per_rank,
        "batch_size": per_rank * info.world_size,
        # None in episode mode: the number of updates depends on the episodes' lengths.
        "num_updates": num_updates(cfg, world_size=info.world_size) if cfg.collector.mode == "fixed" else None,
    }
