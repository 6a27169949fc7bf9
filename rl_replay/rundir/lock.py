"""Run directories: one directory belongs to one run, written by one process at a time.

* A fresh run refuses a directory that already holds files (:func:`claim_fresh`).
* Default names are unique: the directory is created with ``mkdir`` (atomic), and a name
  already taken, e.g. by a run started in the same second, gets a ``-2``, ``-3``... suffix.
* :class:`RunLock` holds ``fcntl.flock`` on ``RUN_DIR/.lock`` for the life of the run. The
  operating system drops the lock when the process dies, so a killed run never leaves a
  stale lock behind; a second live process writing the same directory is refused. The lock
  file is created exclusively or opened without following a symlink (a ``.lock`` linked to a
  file elsewhere is refused, never truncated), and a resume writes its pid into it only once
  everything it read has been checked (:meth:`RunLock.record_pid`).
* A run that stopped before its first checkpoint is no dead end: ``--resume`` restarts it
  in place from update 0 (:func:`resume_kind`), and a fresh run refused there says so.

Every refusal is a :class:`~rl_replay.errors.RunDirError` (a ``SetupError``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from rl_replay.errors import RunDirError, RunWriteError, one_line
from rl_replay.rundir import files
from rl_replay.rundir.checkpoint import CHECKPOINT_NAME, PREVIOUS_NAME
from rl_replay.rundir.metrics_file import read_metrics

__all__ = [
    "LOCK_NAME",
    "RunLock",
    "claim_fresh",
    "claim_default",
    "default_name",
    "resume_kind",
    "logged_updates",
    "writing",
]

LOCK_NAME = ".lock"

# Locks this process holds, by the directory's device and inode: a run directory is owned by a
# process, so a second trainer built in the same process (a resume after an in-process run) takes over.
_HELD: dict[tuple[int, int], RunLock] = {}


class RunLock:
    """An exclusive ``flock`` on ``.lock`` in the run directory ``d``; :meth:`release` (or process
    death) drops it.

    ``record`` writes this process's pid into the file at once (a new run); a resume passes
    False and calls :meth:`record_pid` once it has checked what it read, so that a refused
    resume leaves the run's files as they were.
    """

    def __init__(self, where: files.Dir | str | os.PathLike, *, record: bool = True) -> None:
        with files.held(where) as d:
            self._take(d, record)

    def _take(self, d: files.Dir, record: bool) -> None:
        self.run_dir = d.path
        self.path = d.shown(LOCK_NAME)
        info = os.fstat(d.fd) if d.fd is not None else None
        self._key = (info.st_dev, info.st_ino) if info else (0, id(self))
        previous = _HELD.pop(self._key, None)
        if previous is not None:
            previous.release()
        try:
            self._fd: int | None = d.open_in_place(LOCK_NAME, os.O_RDWR, "lock file")
        except files.UnsafeFileError:
            raise
        except OSError as exc:  # a read-only file system (EROFS), no permission, a full disk
            raise _not_writable(d, exc) from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip()
            os.close(self._fd)
            self._fd = None
            raise RunDirError(
                f"run directory {self.run_dir} is in use by another running process "
                f"(pid {holder if holder.isdigit() else 'unknown'}); wait for it to finish or stop it, "
                "or choose another run_dir."
            ) from None
        _HELD[self._key] = self
        if record:
            self.record_pid()

    def record_pid(self) -> None:
        """Write this process's pid into the lock file (what a refused second process shows)."""
        assert self._fd is not None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        if _HELD.get(self._key) is self:
            del _HELD[self._key]
        os.close(fd)  # closing the descriptor drops the flock


def _not_writable(d: files.Dir | Path, exc: OSError) -> RunDirError:
    """One line for a run directory that cannot be written, naming its last checkpoint."""
    code = errno.errorcode.get(exc.errno or 0)
    latest = None
    if isinstance(d, files.Dir):
        latest = next((d.shown(n) for n in (CHECKPOINT_NAME, PREVIOUS_NAME) if d.exists(n)), None)
    path = d.path if isinstance(d, files.Dir) else d
    kept = f"; its last checkpoint {latest} is unchanged" if latest else ""
    where = os.path.join(path, exc.filename) if exc.filename else path  # (a name in the directory, or a path)
    return RunDirError(
        f"cannot write {where}: {exc.strerror or exc}{f' ({code})' if code else ''}{kept}. "
        "A run directory must be writable: fix the file system or its permissions, or use another directory "
        "(a run copied there resumes from it)."
    )


def _contents(d: files.Dir) -> list[str]:
    return sorted(name for name in d.listdir() if name != LOCK_NAME)


def _has_checkpoint(d: files.Dir) -> bool:
    return d.exists(CHECKPOINT_NAME) or d.exists(PREVIOUS_NAME)


def logged_updates(where: files.Dir | str | os.PathLike) -> str:
    """How far a run's ``metrics.jsonl`` got, in words: ``"3 updates logged"``."""
    records = read_metrics(where)
    last = records[-1]["update"] if records else 0
    return f"{last} update{'' if last == 1 else 's'} logged"


def _not_empty(d: files.Dir, contents: list[str]) -> RunDirError:
    run_dir = d.path
    shown = one_line(", ".join(contents[:4]) + (" ..." if len(contents) > 4 else ""))
    if _has_checkpoint(d):
        return RunDirError(
            f"run directory {run_dir} is not empty ({shown}): continue that run with --resume {run_dir}, "
            "or start a new one with another run_dir=..."
        )
    if "config.yaml" in contents:
        return RunDirError(
            f"run directory {run_dir} holds a run that stopped before its first checkpoint "
            f"({logged_updates(d)}): restart it there from update 0 with --resume {run_dir}, "
            "or start a new one with another run_dir=..."
        )
    return RunDirError(
        f"run directory {run_dir} is not empty ({shown}) and holds no run (no config.yaml): "
        "start the new run with another run_dir=..."
    )


def resume_kind(where: files.Dir | str | os.PathLike) -> str:
    """``"checkpoint"`` if the run in ``where`` can continue from a checkpoint, ``"restart"`` if it
    stopped before its first one (it starts again from update 0 with its config.yaml).

    Raises :class:`RunDirError` if it holds no run (or does not exist), with the way to start one.
    """
    if not isinstance(where, files.Dir):
        try:
            with files.Dir.open(where) as d:
                return resume_kind(d)
        except FileNotFoundError:
            raise RunDirError(
                f"cannot resume {os.fspath(where)}: no such directory. Start a new run there with run_dir={os.fspath(where)}"
            ) from None
    d = where
    if d.exists("config.yaml") and not d.is_regular("config.yaml"):
        d.read_regular("config.yaml", "config", limit=0)  # raises the one line naming it
    if not d.exists("config.yaml"):
        where = f"run_dir={d.path}" if not _contents(d) else "another run_dir=..."
        raise RunDirError(f"cannot resume {d.path}: it holds no run (no config.yaml). Start a new run with {where}")
    return "checkpoint" if _has_checkpoint(d) else "restart"


def claim_fresh(run_dir: str | os.PathLike) -> tuple[files.Dir, RunLock]:
    """Create (or accept an empty) ``run_dir`` for a new run, open and lock it.

    Raises :class:`RunDirError` if it holds anything (another run's files) or is locked.
    """
    run_dir = Path(run_dir)
    if os.path.lexists(run_dir) and not run_dir.is_dir():
        raise RunDirError(f"run directory {run_dir} exists and is not a directory; choose another run_dir=...")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _not_writable(run_dir, exc) from None
    d = files.Dir.open(run_dir)
    try:
        contents = _contents(d)
        if contents:
            raise _not_empty(d, contents)
        lock = RunLock(d)
        contents = _contents(d)  # another fresh run may have won the race before our lock
        if contents:
            lock.release()
            raise _not_empty(d, contents)
    except BaseException:
        d.close()
        raise
    return d, lock


def default_name(env_id: str) -> str:
    """``<env id>-<YYYYmmdd-HHMMSS>`` (``/`` replaced: one path component)."""
    return f"{env_id.replace('/', '_').replace(':', '_')}-{time.strftime('%Y%m%d-%H%M%S')}"


def claim_default(parent: str | os.PathLike, name: str) -> tuple[files.Dir, RunLock]:
    """Create ``parent/name`` (or ``name-2``, ``name-3``... if taken), open and lock it."""
    parent = Path(parent)
    for i in range(1, 10_000):
        candidate = parent / (name if i == 1 else f"{name}-{i}")
        try:
            parent.mkdir(parents=True, exist_ok=True)
            candidate.mkdir()  # atomic: exactly one process creates a given name
        except FileExistsError:
            continue
        except OSError as exc:
            raise _not_writable(candidate, exc) from None
        d = files.Dir.open(candidate)
        try:
            return d, RunLock(d)
        except BaseException:
            d.close()
            raise
    raise RunDirError(f"no free run directory name {parent / name}-N; set run_dir=...")  # pragma: no cover


@contextlib.contextmanager
def writing(path: str | os.PathLike, run_dir: str | os.PathLike, last_checkpoint: str | None) -> Iterator[None]:
    """Turn the ``OSError`` of a write to ``path`` (ENOSPC, EROFS...) into a one-line
    :class:`~rl_replay.errors.RunWriteError` naming it and the last good checkpoint."""
    try:
        yield
    except OSError as exc:
        raise RunWriteError(exc, path, last_checkpoint, str(run_dir)) from None
