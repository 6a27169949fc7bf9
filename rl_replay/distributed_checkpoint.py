"""Checkpoints of FSDP1 runs: one file, readable by a single process.

Layout of ``run_dir/checkpoint.pt`` (the top-level keys of a single-process checkpoint,
plus ``world_size``):

=================  ==============================================================
``agent``          the full agent state dict with the original parameter names,
                   gathered on rank 0 (``FULL_STATE_DICT``, in host memory):
                   ``scripts/evaluate.py RUN_DIR`` loads it into an unwrapped agent.
``optimizer``      the full optimizer state from ``FSDP.optim_state_dict`` (keyed
                   by parameter name, not by index as in a single-process file).
``collector``      list indexed by rank: each rank's collector state.
``rng``            list indexed by rank: torch / numpy / python (and CUDA) RNG states.
``recent_returns`` list indexed by rank: each rank's recent episode returns.
``update``, ``env_steps``, ``wandb_id``, ``config``: as in a single-process file.
``world_size``     number of processes that wrote it; a resume needs the same.
=================  ==============================================================

Saving is collective (every rank calls :func:`save_distributed`); rank 0 gathers and
writes atomically with :func:`rl_replay.checkpoint.save_checkpoint`, then tells every
rank whether the write succeeded, so no rank runs ahead of the file and a failed write
fails every rank instead of hanging them. Resuming: each rank reads the file itself
(:func:`read_distributed`), then :func:`load_distributed` loads the agent and optimizer
through FSDP's full-state-dict loaders and takes its own entries of the per-rank lists.
"""

from __future__ import annotations

import contextlib
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rl_replay.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint
from rl_replay.config import config_to_dict
from rl_replay.errors import SetupError

__all__ = ["save_distributed", "read_distributed", "load_distributed", "check_world_size"]


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


def _map_tensors(obj: Any, device: torch.device | str) -> Any:
    """``obj`` with every tensor in nested dicts / lists / tuples moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, device) for v in obj)
    return obj


def _rank_state(trainer) -> dict[str, Any]:
    """What differs between ranks: collector, RNG streams, recent returns (on the CPU)."""
    rng: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if trainer.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(trainer.device)
    return {
        "collector": _map_tensors(trainer.collector.state_dict(), "cpu"),
        "rng": rng,
        "recent_returns": list(trainer.recent_returns),
    }


def save_distributed(trainer) -> None:
    """Write ``trainer``'s checkpoint; call it on every rank (it is a collective)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    info = trainer.info
    model = trainer.model
    with _full_state_dict_type(model, trainer.device, rank0_only=True):
        agent_state = model.state_dict()  # empty on ranks other than 0
        optim_state = FSDP.optim_state_dict(model, trainer.optimizer)
    gathered: list[Any] | None = [None] * info.world_size if info.is_main else None
    dist.gather_object(_rank_state(trainer), gathered, dst=0)
    error = None
    if info.is_main:
        assert gathered is not None
        payload = {
            "update": trainer.update,
            "env_steps": trainer.env_steps,
            "agent": agent_state,
            "optimizer": optim_state,
            "collector": [g["collector"] for g in gathered],
            "rng": [g["rng"] for g in gathered],
            "recent_returns": [g["recent_returns"] for g in gathered],
            "wandb_id": trainer.logger.wandb_id,
            "config": config_to_dict(trainer.cfg),
            "world_size": info.world_size,
        }
        try:
            save_checkpoint(payload, checkpoint_path(trainer.run_dir))
        except BaseException as exc:  # tell the other ranks before failing
            error = f"{type(exc).__name__}: {exc}"
            box = [error]
            dist.broadcast_object_list(box, src=0)
            raise
    # Barrier: no rank continues before rank 0 has written (or failed to write) the file.
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise RuntimeError(f"rank 0 failed to write the checkpoint: {box[0]}")


def check_world_size(state: dict[str, Any], world_size: int, where: str | Path) -> None:
    """Raise SetupError unless the checkpoint was written by ``world_size`` processes."""
    saved = int(state.get("world_size", 1))
    if saved != world_size:
        raise SetupError(
            f"cannot resume {where}: its checkpoint was written with world size {saved} but this "
            f"run has world size {world_size}. Resume with the same number of processes "
            f"({'a single process' if saved == 1 else f'torchrun with {saved} processes in all, e.g. --nproc_per_node={saved}'})."
        )


def read_distributed(run_dir: str | Path, info) -> dict[str, Any]:
    """Each rank reads the checkpoint itself (on the CPU) and checks the world size."""
    path = checkpoint_path(run_dir)
    state = load_checkpoint(path)
    check_world_size(state, info.world_size, path)
    return state


def load_distributed(trainer, state: dict[str, Any]) -> None:
    """Restore ``trainer`` from ``state`` (from :func:`read_distributed`); collective."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    info = trainer.info
    check_world_size(state, info.world_size, trainer.run_dir)
    model = trainer.model
    # Every rank holds the full state (it read the file), so no rank0_only broadcast.
    with _full_state_dict_type(model, trainer.device, rank0_only=False):
        model.load_state_dict(state["agent"])
        optim_state = FSDP.optim_state_dict_to_load(model, trainer.optimizer, state["optimizer"])
    trainer.optimizer.load_state_dict(optim_state)
    trainer.update = state["update"]
    trainer.env_steps = state["env_steps"]
    rank = info.rank
    trainer.collector.load_state_dict(_map_tensors(state["collector"][rank], trainer.device))
    rng = state["rng"][rank]
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if "cuda" in rng and trainer.device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], trainer.device)
    trainer.recent_returns.extend(state["recent_returns"][rank])
