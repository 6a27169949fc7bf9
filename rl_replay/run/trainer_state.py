"""A trainer's state: what its checkpoint holds, one code path for single-process, FSDP1 and FSDP2 runs.

Three things are called "checkpoint" in this project; this module is the trainer's state that goes
into one. The file format is :mod:`rl_replay.rundir.checkpoint`, and ``checkpoint_fsdp_forward`` is the
reference helper's name for a replay block (activation checkpointing's sense of the word).

Layout of ``run_dir/checkpoint.pt`` (written with :func:`rl_replay.rundir.checkpoint.save_checkpoint`:
numbers and JSON only, nothing that runs code when read):

=================  ==============================================================
``agent``          the full agent state dict with the original parameter names (under
                   FSDP gathered on rank 0 (FSDP1's ``FULL_STATE_DICT``, FSDP2's
                   ``get_state_dict(full_state_dict=True)``), in host memory, or, with
                   ``checkpoint.sharded``, each rank's rows in its shard file, which
                   :mod:`rl_replay.rundir.shards` puts back together when the checkpoint is read):
                   ``scripts/evaluate.py RUN_DIR`` loads it into an unwrapped agent.
``optimizer``      ``optimizer.state_dict()`` in one process; under FSDP the full state
                   from ``FSDP.optim_state_dict`` or FSDP2's ``get_state_dict`` (keyed by
                   parameter name, not index). Both FSDP versions write and read the same
                   full state, so a run resumes under the other version (and in one process).
``collector``      list indexed by rank: each rank's collector state, without its env
                   pickle (that is in ``env_state.pkl``).
``rng``            list indexed by rank: :func:`capture_rng`
                   (python, numpy, torch and, on CUDA, the CUDA generator).
``recent_returns`` list indexed by rank: each rank's recent episode returns.
``env_state``      sha256 of the ``env_state.pkl`` payload written with it (None: no env pickles).
``update``, ``env_steps``, ``wandb_id``, ``config``, ``config_sha256``
``world_size``     number of processes that wrote it. A resume on another number (one process, or
                   any number of torchrun ranks) loads the full weights and optimizer state
                   resharded for its own ranks; rank r < ``world_size`` continues rank r's
                   collector, envs, recent returns and RNG streams, a rank past them starts fresh
                   episodes with streams from the run's seed and its rank (:func:`world_change`).
=================  ==============================================================

The functions here take the algorithm (agent, optimizer, collectors), the trainer's
:class:`Progress` and the :class:`RunPlace` (config, ranks, device, run directory), never a trainer:
:func:`save_trainer` writes ``algorithm`` and ``progress``, :func:`load_trainer` loads the first and
returns the second. Saving is collective (every rank calls :func:`save_trainer`); the ranks write their shards (if
sharded), rank 0 gathers the rest and writes ``checkpoint.pt``, then tells every rank whether the
write succeeded, so no rank runs ahead of the file and
a failed write fails every rank instead of hanging them. Resuming: each rank reads the
files itself (:func:`read_trainer_state`: the env pickles only if this user's MAC verifies,
and every rank then agrees on using them or not), :func:`load_trainer` loads agent, optimizer and
collector into the algorithm that owns them (FSDP1 through its full-state-dict loaders, FSDP2
through ``set_state_dict``) and gives
back the counters (:class:`Progress`), and :func:`restore_trainer_rng` sets the RNG streams last.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import numbers
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rl_replay import distributed as dist_utils
from rl_replay._compat import current_agent_key, current_agent_keys
from rl_replay.config import config_to_dict
from rl_replay.distributed import fsdp_version_of
from rl_replay.errors import CheckpointError, one_line, shown
from rl_replay.rundir import shards, trust
from rl_replay.rundir.checkpoint import (
    checkpoint_path,
    load_agent_weights,
    non_finite_tensors,
    require,
    require_counts,
    save_checkpoint,
)
from rl_replay.rundir.door import RunDirectory
from rl_replay.rundir.env_state_file import env_binding, save_env_state

__all__ = [
    "trainer_state",
    "save_trainer",
    "writes_shards",
    "read_trainer_state",
    "load_trainer",
    "Progress",
    "RunPlace",
    "restore_trainer_rng",
    "world_change",
    "version_change",
    "capture_rng",
    "restore_rng",
    "check_rng",
    "load_agent_weights",
    "optimizer_state_problem",
]


RECENT_RETURNS = 100  # the episodes train/return_mean averages over


@dataclass
class Progress:
    """How far a run got: the trainer's own state (weights, optimizer and collectors are the
    algorithm's). :func:`save_trainer` writes it beside the algorithm's state and
    :func:`load_trainer` gives it back."""

    update: int = 0
    env_steps: int = 0  # summed over all ranks
    recent_returns: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=RECENT_RETURNS))
    last_checkpoint: str | None = None  # "PATH (update N)" of the checkpoint written or loaded last

    def __post_init__(self) -> None:
        if not isinstance(self.recent_returns, collections.deque) or self.recent_returns.maxlen != RECENT_RETURNS:
            self.recent_returns = collections.deque(self.recent_returns, maxlen=RECENT_RETURNS)


@dataclass(frozen=True)
class RunPlace:
    """Where and for what a trainer's state is written: the same for every checkpoint of a run
    (not state). ``wandb_id`` is the run's wandb id, if it logs to wandb."""

    cfg: Any
    info: Any  # rl_replay.distributed.DistInfo
    device: torch.device
    directory: RunDirectory
    run_id: str | None = None
    wandb_id: str | None = None


def _is_fsdp(model: torch.nn.Module) -> bool:
    return type(model).__name__ == "FullyShardedDataParallel"


@contextlib.contextmanager
def _full_state_dict_type(model: torch.nn.Module, device: torch.device, *, rank0_only: bool):
    """FULL_STATE_DICT for the model and the optimizer, gathered into host memory.

    ``offload_to_cpu`` is set only when the compute device is not the CPU: FSDP1's
    ``FlatParamHandle.to_cpu`` moves the unsharded flat parameter "to the CPU" (a no-op
    there) and then frees its storage, so on a CPU device the state dict reads freed
    memory (a segmentation fault in ``_full_post_state_dict_hook``, torch 2.13). On the
    CPU the gathered tensors are in host memory anyway.
    """
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    offload = device.type != "cpu"
    with warnings.catch_warnings():
        # torch >= 2.4 suggests torch.distributed.checkpoint.state_dict; FSDP1 keeps these.
        warnings.filterwarnings("ignore", message=".*state_dict_type.*deprecated.*", category=FutureWarning)
        with FSDP.state_dict_type(
            model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only),
            FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only),
        ):
            yield


@contextlib.contextmanager
def _sharded_state_dict_type(model: torch.nn.Module, device: torch.device):
    """SHARDED_STATE_DICT for the model and the optimizer: each rank's rows of every tensor."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType

    offload = device.type != "cpu"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*state_dict_type.*deprecated.*", category=FutureWarning)
        # FSDP1's sharded state dict is built of ShardedTensors, which torch marks deprecated, with
        # a process-group helper that torch marks deprecated too (torch 2.13).
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*_get_pg_default_device.*", category=UserWarning)
        warnings.filterwarnings("ignore", message=".*Multiple backends are registered.*", category=UserWarning)
        with FSDP.state_dict_type(
            model,
            StateDictType.SHARDED_STATE_DICT,
            ShardedStateDictConfig(offload_to_cpu=offload),
            ShardedOptimStateDictConfig(offload_to_cpu=offload),
        ):
            yield


def writes_shards(model: torch.nn.Module, info, sharded: bool) -> bool:
    """Whether every rank writes its own shard of the weights and optimizer state
    (``checkpoint.sharded`` under FSDP with more than one rank and parameters that are sharded)."""
    version = fsdp_version_of(model)
    if not (sharded and info.distributed and info.world_size > 1 and version):
        return False
    if version == 2:
        return dist_utils.splits_parameters(model)
    from torch.distributed.fsdp import ShardingStrategy

    return model.sharding_strategy != ShardingStrategy.NO_SHARD


def _fsdp2_options(full: bool):
    """``torch.distributed.checkpoint``'s state-dict options: whole tensors (gathered on rank 0
    when saving; given to every rank when loading) or each rank's DTensor shards, in host memory."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=True)


def _model_state(algorithm, device: torch.device, sharded: bool) -> tuple[Any, Any]:
    """The agent's and the optimizer's state dicts (under FSDP: full on rank 0 only, or each
    rank's shards); collective under FSDP."""
    model, optimizer = algorithm.model, algorithm.optimizer
    if fsdp_version_of(model) == 2:
        # The DCP state-dict API; its file format is not used (it unpickles its metadata on
        # load): the shards go into this project's own files (rl_replay.rundir.shards).
        from torch.distributed.checkpoint.state_dict import get_state_dict

        return get_state_dict(model, optimizer, options=_fsdp2_options(full=not sharded))
    if not _is_fsdp(model):
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    how = _sharded_state_dict_type(model, device) if sharded else _full_state_dict_type(model, device, rank0_only=True)
    with how:
        return model.state_dict(), FSDP.optim_state_dict(model, optimizer)


def _save_shards(place: RunPlace, chunks: list[dict[str, Any]], path: Path) -> list[dict[str, Any]]:
    """Every rank writes its chunks at once; the manifest's records of the files, on every rank.
    Collective: a rank that cannot write, or non-finite weights on any rank, fail every rank
    (before anything is written, for the weights)."""
    import torch.distributed as dist

    info = place.info
    bad = shards.non_finite_chunks(chunks)
    flags: list[Any] = [None] * info.world_size
    dist.all_gather_object(flags, bad)
    bad = sorted({name for names in flags for name in names})
    if bad:
        raise CheckpointError(
            f"refusing to write {path}: agent weights {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''} "
            "are not finite; the previous checkpoint is kept."
        )
    record: Any
    try:
        record = shards.save_shard(place.directory.dir, info.rank, info.world_size, chunks)
    except Exception as exc:  # told to every rank below
        record = f"{type(exc).__name__}: {exc}"
    records: list[Any] = [None] * info.world_size
    dist.all_gather_object(records, record)
    failed = [f"rank {r}: {one_line(str(x))}" for r, x in enumerate(records) if isinstance(x, str)]
    if failed:
        raise CheckpointError(
            f"could not write the shards of {path} ({'; '.join(failed)}); the previous checkpoint is kept."
        )
    return records


def _map_tensors(obj: Any, device: torch.device | str) -> Any:
    """``obj`` with every tensor in nested dicts / lists / tuples moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, device) for v in obj)
    return obj


def _rank_state(algorithm, progress: Progress, device: torch.device) -> dict[str, Any]:
    """What differs between ranks: collector, RNG streams, recent returns (on the CPU)."""
    return {
        "collector": _map_tensors(algorithm.collector.state_dict(), "cpu"),
        "rng": capture_rng(device),
        "recent_returns": list(progress.recent_returns),
    }


def _gather_to_main(obj: Any, info) -> list[Any] | None:
    if not info.distributed:
        return [obj]
    import torch.distributed as dist

    gathered: list[Any] | None = [None] * info.world_size if info.is_main else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def trainer_state(
    algorithm, progress: Progress, place: RunPlace, model_state: tuple[Any, Any] | None = None
) -> dict[str, Any] | None:
    """A run's whole state (the ``algorithm``'s agent, optimizer and collectors, the ``progress``,
    the RNG streams) as a tree of tensors and plain values; call it on every rank.

    A collective under FSDP (the full agent and optimizer state are gathered on rank 0, unless
    ``model_state`` gives the agent's and optimizer's state already), so it returns the state on the
    main process and ``None`` on the others. Each collector state still holds its env pickle under
    ``"envs"``; :func:`save_trainer` moves those to their own file.
    """
    info = place.info
    agent_state, optim_state = (
        model_state if model_state is not None else _model_state(algorithm, place.device, sharded=False)
    )
    gathered = _gather_to_main(_rank_state(algorithm, progress, place.device), info)
    if not info.is_main:
        return None
    assert gathered is not None
    config = config_to_dict(place.cfg)
    return {
        "update": progress.update,
        "env_steps": progress.env_steps,
        "agent": agent_state,
        "optimizer": optim_state,
        "collector": [g["collector"] for g in gathered],
        "rng": [g["rng"] for g in gathered],
        "recent_returns": [g["recent_returns"] for g in gathered],
        "wandb_id": place.wandb_id,
        "config": config,
        "config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest(),
        "world_size": info.world_size,
    }


def save_trainer(algorithm, progress: Progress, place: RunPlace) -> Path:
    """Write the checkpoint of ``algorithm`` and ``progress`` into ``place``; call it on every rank
    (a collective under FSDP). :func:`load_trainer` reads it back.

    Returns the path written. Raises on every rank if rank 0 could not write it (e.g. a
    :class:`~rl_replay.errors.CheckpointError` for non-finite weights).
    """
    info, directory = place.info, place.directory  # held open by rank 0, which writes (and the others, for shards)
    path = checkpoint_path(directory.path)
    sharded = writes_shards(algorithm.model, info, place.cfg.checkpoint.sharded)
    agent_state, optim_state = _model_state(algorithm, place.device, sharded)
    manifest = None
    if sharded:
        # Every rank writes its rows of the weights and optimizer state; checkpoint.pt names them.
        tree, chunks, specs = shards.split({"agent": agent_state, "optimizer": optim_state}, rank=info.rank)
        agent_state, optim_state = tree["agent"], tree["optimizer"]
        records = _save_shards(place, chunks, path)
        manifest = {"world": info.world_size, "files": records, "tensors": specs}
    state = trainer_state(algorithm, progress, place, (agent_state, optim_state))
    error: BaseException | None = None
    if state is not None:
        # What must stay a pickle goes to its own file, signed with this user's key.
        collectors = [dict(c) for c in state["collector"]]
        pickles = [c.pop("envs", None) for c in collectors]
        payload = {**state, "collector": collectors, "env_state": None}
        if manifest is not None:
            payload["shards"] = manifest
        try:
            # (Non-finite weights are refused by save_checkpoint; refuse them before the env file too.)
            if any(p is not None for p in pickles) and not non_finite_tensors(state["agent"]):
                binding = env_binding(place.cfg.env, place.run_id)
                payload["env_state"] = save_env_state(pickles, directory.dir, trust.user_secret(), binding)
            save_checkpoint(payload, directory.dir)
        except BaseException as exc:  # tell the other ranks before failing
            error = exc
    # Barrier: no rank continues before rank 0 has written (or failed to write) the file.
    message = dist_utils.broadcast_from_main(None if error is None else str(error), info)
    if error is not None:
        raise error
    if message is not None:
        raise RuntimeError(f"rank 0 failed to write the checkpoint: {message}")
    return path


def world_change(state: dict[str, Any], world_size: int, where: str | Path) -> str | None:
    """The line a resume prints when ``state`` was written by another number of processes than
    ``world_size`` (None when it was not): what is resharded, what continues, what starts fresh."""
    saved = int(state["world_size"])
    if saved == world_size:
        return None
    kept = min(saved, world_size)
    ranks = "rank 0 continues its" if kept == 1 else f"ranks 0-{kept - 1} continue their"
    if world_size > saved:
        one = world_size - saved == 1
        new = f"rank {saved} starts" if one else f"ranks {saved}-{world_size - 1} start"
        rest = f"; {new} fresh episodes with RNG streams from the run's seed and {'its' if one else 'their'} rank"
    else:
        gone = f"rank {world_size}'s" if saved - world_size == 1 else f"ranks {world_size}-{saved - 1}'s"
        rest = f"; {gone} envs end here (their unfinished episodes are not counted)"
    return (
        f"resuming {where} on {_processes(world_size)}; its checkpoint was written by {_processes(saved)}: "
        f"weights and optimizer state resharded, {ranks} envs and RNG streams{rest}; "
        f"update {state['update']}, {state['env_steps']} env steps so far"
    )


def version_change(state: dict[str, Any], fsdp_version: int, distributed: bool, where: str | Path) -> str | None:
    """The line a resume prints when ``state`` was written under another FSDP version than this
    run's (None when it was not, or when either run was one process, where no version applies)."""
    saved_cfg = state.get("config")
    distributed_cfg = saved_cfg.get("distributed") if isinstance(saved_cfg, dict) else None
    saved = distributed_cfg.get("fsdp_version", 1) if isinstance(distributed_cfg, dict) else 1
    if not distributed or int(state["world_size"]) == 1 or saved == fsdp_version:
        return None
    return (
        f"resuming {where} under FSDP{fsdp_version}; its checkpoint was written under FSDP{saved}: both keep "
        "the full weights and optimizer state by parameter name, so they load as they are"
    )


def _processes(n: int) -> str:
    return "one process" if n == 1 else f"{n} ranks"


# What each command needs of a checkpoint (checked before anything is built from it).
RESUME_KEYS = (
    "update",
    "env_steps",
    "agent",
    "optimizer",
    "collector",
    "rng",
    "recent_returns",
    "config",
    "world_size",
)


def read_trainer_state(directory: RunDirectory, info, binding: bytes) -> tuple[dict[str, Any], Path, str | None]:
    """Each rank reads the run's latest readable checkpoint (on the CPU) and checks it.

    ``binding`` is what this run's env state must have been written for
    (:func:`rl_replay.rundir.env_state_file.env_binding`: the run's identity and env config).

    The env pickles are put back into the collector states only where
    :meth:`~rl_replay.rundir.door.RunDirectory.env_state` gives them (this user's MAC, or
    the directory's :class:`~rl_replay.rundir.door.Trust`), and only if every rank has them; otherwise each collector state says
    why it starts fresh episodes. Returns ``(state, path, warning)`` as
    :func:`rl_replay.rundir.checkpoint.load_latest` (``warning`` also names a trusted-but-unverified
    env state).
    """
    state, path, warning = directory.latest()
    require(state, path, RESUME_KEYS, "--resume")
    require_counts(state, path, ("update", "env_steps", "world_size"))
    wandb_id = state.get("wandb_id")
    if wandb_id is not None and not (isinstance(wandb_id, str) and wandb_id.isalnum() and len(wandb_id) <= 64):
        # wandb names files and directories after the id: it must not be a path.
        raise CheckpointError(f"checkpoint {path} holds wandb_id {shown(wandb_id)}, which is not a wandb run id.")
    saved_world = state["world_size"]
    if saved_world < 1:
        raise CheckpointError(f"checkpoint {path} was written by world size {saved_world}, which no run has.")
    for key in ("collector", "rng", "recent_returns"):
        if not isinstance(state[key], list) or len(state[key]) != saved_world:
            raise CheckpointError(
                f"checkpoint {path} holds {key!r} for {len(state[key]) if isinstance(state[key], list) else 'no'} "
                f"ranks, not one per rank of its world size {saved_world}."
            )
    if not all(isinstance(c, dict) for c in state["collector"]):
        raise CheckpointError(f"checkpoint {path} holds a collector state that is not a table.")
    returns = state["recent_returns"]
    if not all(isinstance(r, list) and all(_is_number(x) for x in r) for r in returns):
        raise CheckpointError(f"checkpoint {path} holds recent returns that are not lists of numbers.")
    digest = state.get("env_state")
    found = directory.env_state(digest, trust.user_secret(), binding) if digest else None
    usable = found is not None and found.pickles is not None and len(found.pickles) == saved_world
    if info.distributed:  # every rank resumes its envs, or none does
        import torch.distributed as dist

        flags: list[Any] = [None] * info.world_size
        dist.all_gather_object(flags, usable)
        usable = all(flags)
    pickles = found.pickles if usable and found is not None else None
    for rank, collector in enumerate(state["collector"]):
        collector["envs"] = pickles[rank] if pickles is not None else None
        if digest and not usable:
            why = found.note if found and found.note else "another rank could not use its env state"
            collector["fresh_envs"] = (
                why,
                "resume with --trust-env-state to unpickle it if you trust where it came "
                "from (unpickling can run any code)",
            )
    note = found.note if usable and found is not None else None
    if note:
        warning = f"{warning} {note}" if warning else note
    return state, path, warning


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def load_trainer(algorithm, state: dict[str, Any], place: RunPlace) -> Progress:
    """Load the agent, optimizer and collector of ``state`` (:func:`trainer_state`'s, or a
    checkpoint's: :func:`read_trainer_state`) into ``algorithm`` (their owner; collective under
    FSDP) and return its :class:`Progress`.

    The RNG streams are restored separately (:func:`restore_trainer_rng`), last.
    """
    info, device, where = place.info, place.device, place.directory.path
    model, optimizer = algorithm.model, algorithm.optimizer
    fsdp2 = fsdp_version_of(model) == 2
    if fsdp2:
        # Every rank holds the full state (it read the file); DCP's loaders keep this rank's shards.
        optim_state = _optimizer_state_by_name(model, state["optimizer"])
    elif _is_fsdp(model):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # Every rank holds the full state (it read the file), so no rank0_only broadcast; FSDP
        # shards it for this run's ranks, however many wrote it.
        with _full_state_dict_type(model, device, rank0_only=False):
            model.load_state_dict(current_agent_keys(state["agent"], _agent_names(model)))
            saved = _optimizer_state_by_name(model, state["optimizer"])
            optim_state = FSDP.optim_state_dict_to_load(model, optimizer, saved)
    else:
        model.load_state_dict(current_agent_keys(state["agent"], model.state_dict()))
        optim_state = _optimizer_state_by_index(model, state["optimizer"])
    # (FSDP2's state stays keyed by name for DCP; the check reads it keyed by index, as one process does.)
    problem = optimizer_state_problem(
        optimizer, _optimizer_state_by_index(model, optim_state) if fsdp2 else optim_state
    )
    if problem is not None:
        raise CheckpointError(
            f"cannot resume {where}: its checkpoint holds optimizer state that does not fit this run's "
            f"{type(optimizer).__name__} ({problem}); resume with the optimizer that wrote it, or start a new run."
        )
    if fsdp2:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            model,
            optimizer,
            model_state_dict=current_agent_keys(state["agent"], _agent_names(model)),
            optim_state_dict=optim_state,
            options=_fsdp2_options(full=True),
        )
    else:
        optimizer.load_state_dict(optim_state)
    if info.rank >= state["world_size"]:  # a rank the writer did not have: fresh episodes (world_change)
        return Progress(state["update"], state["env_steps"])
    algorithm.collector.load_state_dict(_map_tensors(state["collector"][info.rank], device))
    return Progress(state["update"], state["env_steps"], collections.deque(state["recent_returns"][info.rank]))


def _parameter_names(model: torch.nn.Module) -> list[str]:
    """``model``'s parameter names in the optimizer's order, as a plain agent names them."""
    return [name.replace("_fsdp_wrapped_module.", "") for name, _ in model.named_parameters()]


def _agent_names(model: torch.nn.Module) -> set[str]:
    """The names of ``model``'s state dict, as a plain agent names them (without a collective)."""
    buffers = [name.replace("_fsdp_wrapped_module.", "") for name, _ in model.named_buffers()]
    return {*_parameter_names(model), *buffers}


def _current_names(model: torch.nn.Module, saved: dict) -> dict:
    """A name-keyed optimizer state with an older checkpoint's parameter names as ``model``
    names them (:func:`rl_replay._compat.current_agent_key`)."""
    own = set(_parameter_names(model))
    names = {k: current_agent_key(k, own) for k in saved["state"] if isinstance(k, str)}
    for group in saved.get("param_groups") or []:
        if isinstance(group, dict) and isinstance(group.get("params"), list):
            names.update((p, current_agent_key(p, own)) for p in group["params"] if isinstance(p, str))
    return _renamed(saved, names)


def _optimizer_state_by_name(model: torch.nn.Module, saved: Any) -> Any:
    """A one-process optimizer state (keyed by parameter index) keyed by parameter name, as
    ``FSDP.optim_state_dict`` writes it; a state keyed by name already is returned as it is."""
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict):
        return saved  # optimizer_state_problem names what is wrong
    if not any(isinstance(k, int) for k in saved["state"]) and not _groups_hold(saved, int):
        return _current_names(model, saved)
    return _renamed(saved, dict(enumerate(_parameter_names(model))))


def _optimizer_state_by_index(model: torch.nn.Module, saved: Any) -> Any:
    """An FSDP run's full optimizer state (keyed by parameter name) keyed by the index of
    ``model``'s parameter, as ``optimizer.state_dict()`` keys it; an index-keyed state is
    returned as it is."""
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict):
        return saved
    if not any(isinstance(k, str) for k in saved["state"]) and not _groups_hold(saved, str):
        return saved
    return _renamed(_current_names(model, saved), {n: i for i, n in enumerate(_parameter_names(model))})


def _groups_hold(saved: dict, kind: type) -> bool:
    groups = saved.get("param_groups")
    return isinstance(groups, list) and any(
        isinstance(g, dict) and isinstance(g.get("params"), list) and any(isinstance(p, kind) for p in g["params"])
        for g in groups
    )


def _renamed(saved: dict, names: dict) -> dict:
    """``saved`` with its parameter keys mapped through ``names``; a key it has no name for is
    kept as it is (the optimizer state check then names it)."""
    groups = saved.get("param_groups")
    if isinstance(groups, list):
        groups = [
            {**g, "params": [names.get(p, p) if isinstance(p, (int, str)) else p for p in g["params"]]}
            if isinstance(g, dict) and isinstance(g.get("params"), list)
            else g
            for g in groups
        ]
    return {**saved, "state": {names.get(k, k): v for k, v in saved["state"].items()}, "param_groups": groups}


def _kind(value: Any) -> str:
    return f"a {type(value).__name__}"


def _hyperparameter_problem(name: str, saved: Any, own: Any) -> str | None:
    """Why a saved ``param_groups`` entry cannot stand for the optimizer's own value, or None."""
    if isinstance(own, bool) or own is None:
        return None if saved is None or isinstance(saved, bool) else f"{name} is {_kind(saved)}"
    if isinstance(own, numbers.Real) or isinstance(own, torch.Tensor):
        if isinstance(saved, torch.Tensor) and saved.numel() == 1:
            saved = saved.item()
        if not _is_number(saved) or not np.isfinite(saved):
            return f"{name} is {_kind(saved)}" if not _is_number(saved) else f"{name} is {saved}"
        return None
    if isinstance(own, (tuple, list)):
        if not isinstance(saved, (tuple, list)) or len(saved) != len(own):
            return f"{name} is {_kind(saved)}"
        return next((p for a, b in zip(saved, own) if (p := _hyperparameter_problem(name, a, b))), None)
    return None


def optimizer_state_problem(optimizer: torch.optim.Optimizer, saved: Any) -> str | None:
    """Why ``saved`` (an ``optimizer.state_dict()`` from a file) does not fit ``optimizer``, or None.

    ``Optimizer.load_state_dict`` checks the group sizes only: a state tensor of another shape
    or type would fail mid-update (after a resume has rewritten the run's files) or, broadcast,
    not fail at all. So each entry is checked against its parameter first: a tensor of the
    parameter's shape and dtype, or a scalar (``step``), or None (SGD's empty momentum).
    """
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict):
        what = saved.get("state") if isinstance(saved, dict) else saved
        return f"state is {_kind(what)}, not a table"
    groups, own_groups = saved.get("param_groups"), optimizer.param_groups
    if not isinstance(groups, list) or len(groups) != len(own_groups) or not all(isinstance(g, dict) for g in groups):
        return "its parameter groups are not this optimizer's"
    params: dict[Any, torch.Tensor] = {}
    for group, own in zip(groups, own_groups):
        ids = group.get("params")
        if not isinstance(ids, list) or len(ids) != len(own["params"]):
            return "its parameter groups are not this optimizer's"
        params.update(zip(ids, own["params"]))
        for name, value in own.items():
            if name != "params" and name in group:
                problem = _hyperparameter_problem(name, group[name], value)
                if problem:
                    return problem
    for index, entry in saved["state"].items():
        if index not in params:
            return f"state for parameter {shown(index)}, which it has no group for"
        if not isinstance(entry, dict):
            return f"parameter {index}'s state is {_kind(entry)}"
        param = params[index]
        for name, value in entry.items():
            if name == "step":
                ok = _is_number(value) or (isinstance(value, torch.Tensor) and value.numel() == 1)
                if not ok:
                    return f"parameter {index}'s step is {_kind(value)}"
            elif value is None:
                continue
            elif not isinstance(value, torch.Tensor):
                return f"parameter {index}'s {shown(name)[1:-1]} is {_kind(value)}"
            elif value.dim() and tuple(value.shape) != tuple(param.shape):
                return f"parameter {index}'s {name} of shape {tuple(value.shape)}, not {tuple(param.shape)}"
            elif value.dim() and value.dtype != param.dtype:
                return f"parameter {index}'s {name} of dtype {value.dtype}, not {param.dtype}"
    return None


def restore_trainer_rng(state: dict[str, Any], info, device: torch.device) -> None:
    """Set this rank's RNG streams from ``state`` (call it after everything else is set up); a rank
    past the writer's keeps the streams it was seeded with (the run's seed and its rank)."""
    if info.rank < state["world_size"]:
        restore_rng(state["rng"][info.rank], device)


# ------------------------------------------------------------------------------ RNG state
def capture_rng(device: torch.device | str = "cpu") -> dict[str, Any]:
    """Python, numpy, torch CPU and (on a CUDA device) CUDA RNG states of this process."""
    device = torch.device(device)
    rng: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return rng


def restore_rng(rng: dict[str, Any], device: torch.device | str = "cpu") -> None:
    """Inverse of :func:`capture_rng` (the CUDA state only when both sides have one)."""
    device = torch.device(device)
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if "cuda" in rng and device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], device)


def check_rng(rng: Any, device: torch.device | str = "cpu") -> None:
    """Raise ValueError (one line) unless :func:`restore_rng` accepts ``rng``; changes nothing.

    A checkpoint's RNG states are checked by restoring them and then this process's own
    states, before a resume writes anything.
    """
    saved = capture_rng(device)
    try:
        if not isinstance(rng, dict):
            raise TypeError(f"a {type(rng).__name__}, not a table of generator states")
        restore_rng(rng, device)
    except (TypeError, ValueError, KeyError, IndexError, RuntimeError, OverflowError) as exc:
        raise ValueError(
            f"RNG states that cannot be restored ({type(exc).__name__}: {one_line(str(exc))[:160]})"
        ) from None
    finally:
        restore_rng(saved, device)


# ---------------------------------------------------------------------------- agent weights
