"""Atomic checkpoints: a run can be killed at any moment and resumed from the last one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["CHECKPOINT_NAME", "save_checkpoint", "load_checkpoint", "checkpoint_path"]

CHECKPOINT_NAME = "checkpoint.pt"


def checkpoint_path(run_dir: str | os.PathLike) -> Path:
    """Where a run keeps its latest checkpoint."""
    return Path(run_dir) / CHECKPOINT_NAME


def save_checkpoint(payload: dict[str, Any], path: str | os.PathLike) -> None:
    """Write ``payload`` with ``torch.save`` to a temporary file, fsync it, then rename.

    ``os.replace`` is atomic on POSIX: a reader (or a resume after a kill) sees either
    the previous checkpoint or the new one, never a partial file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` onto the CPU."""
    path = Path(path)
    if path.is_dir():
        path = checkpoint_path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    # The payload holds numpy RNG state and pickled envs, so full unpickling is needed;
    # only load checkpoints you wrote.
    return torch.load(path, map_location="cpu", weights_only=False)
