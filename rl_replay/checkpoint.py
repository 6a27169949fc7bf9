"""Checkpoint files that are written atomically, verified on load and never lost.

File format: one header line, then the ``torch.save`` payload bytes::

    RLREPLAY-CHECKPOINT 1 sha256=<64 hex digits> size=<payload bytes>\\n
    <payload>

:func:`save_checkpoint` refuses non-finite agent weights, writes a temporary file in the
same directory, fsyncs it, reads it back and checks its checksum, keeps the checkpoint it
replaces as ``checkpoint.prev.pt`` and only then renames the new file into place
(``os.replace`` is atomic on POSIX: a reader, or a resume after a kill, sees either the old
file or the new one). :func:`load_checkpoint` verifies size and checksum and raises a
one-line :class:`~rl_replay.errors.CheckpointError` naming the file for an empty, truncated
or corrupt one; :func:`load_latest` falls back to the previous checkpoint.

Files written before the header existed (a bare ``torch.save``) still load, unverified.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rl_replay.errors import CheckpointError

__all__ = [
    "CHECKPOINT_NAME", "PREVIOUS_NAME", "save_checkpoint", "load_checkpoint",
    "load_latest", "checkpoint_path", "previous_checkpoint_path", "remove_stale_temporaries",
    "capture_rng", "restore_rng", "non_finite_tensors",
]

CHECKPOINT_NAME = "checkpoint.pt"
PREVIOUS_NAME = "checkpoint.prev.pt"
_MAGIC = b"RLREPLAY-CHECKPOINT 1 "
_HEADER_MAX = 256


def checkpoint_path(run_dir: str | os.PathLike) -> Path:
    """Where a run keeps its latest checkpoint."""
    return Path(run_dir) / CHECKPOINT_NAME


def previous_checkpoint_path(run_dir: str | os.PathLike) -> Path:
    """Where a run keeps the checkpoint before the latest one."""
    return Path(run_dir) / PREVIOUS_NAME


# ------------------------------------------------------------------------- finite weights
def non_finite_tensors(state: dict[str, Any]) -> list[str]:
    """Names of the floating-point tensors in ``state`` holding NaN or infinity."""
    return [name for name, t in state.items()
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())]


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


# ---------------------------------------------------------------------------- write / read
def _header(payload: bytes) -> bytes:
    return _MAGIC + f"sha256={hashlib.sha256(payload).hexdigest()} size={len(payload)}\n".encode()


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def save_checkpoint(payload: dict[str, Any], path: str | os.PathLike) -> None:
    """Verify, write and rename ``payload`` into ``path``; keep the old file as the previous one.

    Raises :class:`CheckpointError` (and writes nothing) if ``payload["agent"]`` holds a
    non-finite tensor: a diverged model must never replace the last good checkpoint.
    """
    path = Path(path)
    bad = non_finite_tensors(payload.get("agent", {}))
    if bad:
        raise CheckpointError(
            f"refusing to write {path}: agent weights {', '.join(bad[:4])}"
            f"{' ...' if len(bad) > 4 else ''} are not finite; the previous checkpoint is kept."
        )
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getbuffer()
    header = _header(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _read_verified(Path(tmp), shown=path)  # what is on disk is what we meant to write
        if path.exists():
            # Keep the current file as the previous one. A hard link leaves ``path`` in
            # place, so at every moment there is a checkpoint under the usual name.
            previous = path.with_name(PREVIOUS_NAME) if path.name == CHECKPOINT_NAME else \
                path.with_name(path.stem + ".prev" + path.suffix)
            link = Path(tmp + ".prev")
            try:
                os.link(path, link)
            except OSError:  # file systems without hard links
                import shutil

                shutil.copy2(path, link)
            os.replace(link, previous)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        for leftover in (tmp, tmp + ".prev"):
            if os.path.exists(leftover):
                os.unlink(leftover)
        raise


def _read_verified(path: Path, *, shown: Path | None = None) -> bytes | None:
    """The payload bytes of ``path`` after checking header, size and checksum.

    Returns None for a legacy file without a header (its bytes are the payload).
    """
    shown = shown or path
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"checkpoint {shown} is empty (0 bytes): it was cut off while being written.")
    with open(path, "rb") as f:
        head = f.read(len(_MAGIC))
        if head != _MAGIC:
            return None
        line = head + f.readline(_HEADER_MAX)
        data = f.read()
    try:
        fields = dict(part.split("=", 1) for part in line[len(_MAGIC):].decode().split())
        digest, expected = fields["sha256"], int(fields["size"])
    except (ValueError, KeyError, UnicodeDecodeError):
        raise CheckpointError(f"checkpoint {shown} is corrupt: its header is unreadable.") from None
    if len(data) != expected:
        raise CheckpointError(
            f"checkpoint {shown} is truncated or padded: {len(data)} payload bytes instead of {expected}."
        )
    if hashlib.sha256(data).hexdigest() != digest:
        raise CheckpointError(f"checkpoint {shown} is corrupt: its sha256 checksum does not match its contents.")
    return data


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load and verify a checkpoint (a file, or a run directory's latest) onto the CPU.

    Raises FileNotFoundError if it does not exist and :class:`CheckpointError` (one line,
    naming the file) if it is empty, truncated or corrupt.
    """
    path = Path(path)
    if path.is_dir():
        path = checkpoint_path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    data = _read_verified(path)
    # The payload holds numpy RNG state and pickled envs, so full unpickling is needed;
    # only load checkpoints you wrote.
    try:
        source = path if data is None else io.BytesIO(data)
        state = torch.load(source, map_location="cpu", weights_only=False)
    except Exception as exc:  # a legacy file cut short, or not a checkpoint at all
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(exc).__name__}: {exc}).") from None
    if not isinstance(state, dict) or "agent" not in state:
        raise CheckpointError(f"{path} is not an rl_replay checkpoint.")
    return state


def load_latest(run_dir: str | os.PathLike) -> tuple[dict[str, Any], Path, str | None]:
    """The run's latest readable checkpoint: ``(state, path, warning)``.

    Falls back to ``checkpoint.prev.pt`` when ``checkpoint.pt`` is missing or damaged;
    ``warning`` then says so (None otherwise). Raises the latest file's error if neither loads.
    """
    latest, previous = checkpoint_path(run_dir), previous_checkpoint_path(run_dir)
    try:
        return load_checkpoint(latest), latest, None
    except (CheckpointError, FileNotFoundError) as exc:
        if not previous.exists():
            raise
        try:
            state = load_checkpoint(previous)
        except CheckpointError:
            raise exc from None
        return state, previous, f"{exc} Resuming from the previous checkpoint {previous} (update {state['update']})."


def remove_stale_temporaries(run_dir: str | os.PathLike) -> list[Path]:
    """Delete temporary files left by a checkpoint (or config / metrics) write that was killed.

    Returns the files removed. Call it only while holding the run directory's lock (no
    other writer is active).
    """
    removed = []
    for pattern in (".checkpoint*.tmp*", ".config.yaml.*.tmp", "metrics.jsonl.tmp"):
        for tmp in Path(run_dir).glob(pattern):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed
