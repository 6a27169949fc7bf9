"""Run directories: one directory belongs to one run, written by one process at a time.

* A fresh run refuses a directory that already holds files (:func:`claim_fresh`).
* Default names are unique: the directory is created with ``mkdir`` (atomic), and a name
  already taken, e.g. by a run started in the same second, gets a ``-2``, ``-3``... suffix.
* :class:`RunLock` holds ``fcntl.flock`` on ``RUN_DIR/.lock`` for the life of the run. The
  operating system drops the lock when the process dies, so a killed run never leaves a
  stale lock behind; a second live process writing the same directory is refused.

Every refusal is a :class:`~rl_replay.errors.RunDirError` (a ``SetupError``).
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from rl_replay.errors import RunDirError

__all__ = ["LOCK_NAME", "RunLock", "claim_fresh", "claim_default", "default_name"]

LOCK_NAME = ".lock"

# Locks this process holds, by resolved path: a run directory is owned by a process, so a
# second trainer built in the same process (a resume after an in-process run) takes over.
_HELD: dict[str, "RunLock"] = {}


class RunLock:
    """An exclusive ``flock`` on ``run_dir/.lock``; :meth:`release` (or process death) drops it."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        key = str(self.path.resolve())
        previous = _HELD.pop(key, None)
        if previous is not None:
            previous.release()
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            self._fd = None
            raise RunDirError(
                f"run directory {self.run_dir} is in use by another running process (pid {holder}); "
                "wait for it to finish or stop it, or choose another run_dir."
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)
        _HELD[key] = self

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        _HELD.pop(str(self.path.resolve()), None)
        os.close(fd)  # closing the descriptor drops the flock


def _contents(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_NAME)


def _not_empty(run_dir: Path, contents: list[str]) -> RunDirError:
    shown = ", ".join(contents[:4]) + (" ..." if len(contents) > 4 else "")
    return RunDirError(
        f"run directory {run_dir} is not empty ({shown}): continue that run with --resume {run_dir}, "
        "or start a new one with another run_dir=..."
    )


def claim_fresh(run_dir: str | os.PathLike) -> RunLock:
    """Create (or accept an empty) ``run_dir`` for a new run and lock it.

    Raises :class:`RunDirError` if it holds anything (another run's files) or is locked.
    """
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"run directory {run_dir} exists and is not a directory; choose another run_dir=...")
    if run_dir.is_dir():
        contents = _contents(run_dir)
        if contents:
            raise _not_empty(run_dir, contents)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock(run_dir)
    contents = _contents(run_dir)  # another fresh run may have won the race before our lock
    if contents:
        lock.release()
        raise _not_empty(run_dir, contents)
    return lock


def default_name(env_id: str) -> str:
    """``<env id>-<YYYYmmdd-HHMMSS>`` (``/`` replaced: one path component)."""
    return f"{env_id.replace('/', '_').replace(':', '_')}-{time.strftime('%Y%m%d-%H%M%S')}"


def claim_default(parent: str | os.PathLike, name: str) -> tuple[Path, RunLock]:
    """Create ``parent/name`` (or ``name-2``, ``name-3``... if taken) and lock it."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    for i in range(1, 10_000):
        candidate = parent / (name if i == 1 else f"{name}-{i}")
        try:
            candidate.mkdir()  # atomic: exactly one process creates a given name
        except FileExistsError:
            continue
        return candidate, RunLock(candidate)
    raise RunDirError(f"no free run directory name {parent / name}-N; set run_dir=...")  # pragma: no cover
