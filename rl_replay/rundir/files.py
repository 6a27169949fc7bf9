"""The files of a run directory, opened as someone else may have left them.

A run directory may come from another user (docs/operations.md, "Sharing runs"), so none of its
names is taken at its word:

* **Nothing is followed out of the run.** Files are opened with ``O_NOFOLLOW``; a symlink where a
  run file should be is refused, so a ``.lock`` or ``metrics.jsonl`` linked to a file elsewhere
  (a shell rc file) is never truncated or appended to, and a linked checkpoint is never read.
  Files written in place (the lock, ``metrics.jsonl``) must have one link only: a hard link would
  make the write land in another directory too.
* **Only regular files are read**, checked with ``lstat`` before opening (opening some devices has
  effects) and with ``fstat`` after (``O_NONBLOCK``, so a FIFO cannot hang the open). A FIFO,
  device, socket or directory in place of a run file is one line naming it.
* **Reads are bounded**: by a limit per kind of file, by the size a header declares (compared to
  the file's size before anything is read), and by the memory the process can still have.
* **New files are created exclusively** (``O_CREAT | O_EXCL``) and renamed into place; a rename
  replaces a symlink itself, never what it points to.

The checkpoint and env-state files are *headed*: one line ``MAGIC key=value ...`` naming the
payload's ``sha256`` and ``size``, then the payload. :func:`write_atomic` writes one (keeping the
previous file), :func:`header_fields` and :func:`read_payload` read one back.

Every refusal is an :class:`UnsafeFileError` (a :class:`~rl_replay.errors.RunDirError`), one line.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import resource
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from rl_replay.errors import CheckpointError, RunDirError

__all__ = [
    "UnsafeFileError",
    "open_regular",
    "read_regular",
    "iter_lines",
    "open_in_place",
    "create_exclusive",
    "replace_with_text",
    "check_directory",
    "check_affordable",
    "memory_left",
    "is_regular",
    "HEADER_MAX",
    "previous_path",
    "fsync_dir",
    "write_atomic",
    "header_fields",
    "read_payload",
]

#: The longest header line of a headed file.
HEADER_MAX = 512

_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class UnsafeFileError(RunDirError):
    """A run file is not a regular file of this run, or is larger than it may be."""


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _refuse(path: str | os.PathLike, what: str, kind: str) -> UnsafeFileError:
    return UnsafeFileError(
        f"{what} {os.fspath(path)} is {kind}, not a regular file: a run directory holds regular files only. "
        "Remove it (or copy the run without it) and try again."
    )


def is_regular(path: str | os.PathLike) -> bool:
    """Whether ``path`` itself (not what a symlink points to) is a regular file."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _open_fd(path: str | os.PathLike, flags: int, what: str, *, follow: bool = False, mode: int = 0o644) -> int:
    """``os.open`` that refuses anything but a regular file (and, unless ``follow``, a symlink)."""
    if not follow:
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            if not flags & os.O_CREAT:
                raise
        else:
            if not stat.S_ISREG(info.st_mode):
                raise _refuse(path, what, _kind(info.st_mode))
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW), mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink made after the lstat
            raise _refuse(path, what, "a symbolic link") from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise _refuse(path, what, _kind(info.st_mode))
    os.set_blocking(fd, True)
    return fd


@contextlib.contextmanager
def open_regular(path: str | os.PathLike, what: str, *, follow: bool = False) -> Iterator[tuple[BinaryIO, int]]:
    """``(file, size)`` of the regular file ``path`` opened for reading, closed on exit.

    ``what`` names the file in errors ("checkpoint"). ``follow`` lets a path the user named
    be a symlink (never a run directory's own files). Raises FileNotFoundError if it does not
    exist and :class:`UnsafeFileError` if it is not a regular file.
    """
    fd = _open_fd(path, os.O_RDONLY, what, follow=follow)
    f = os.fdopen(fd, "rb")
    try:
        yield f, os.fstat(fd).st_size
    finally:
        f.close()


def read_regular(path: str | os.PathLike, what: str, *, limit: int, follow: bool = False) -> bytes:
    """The bytes of the regular file ``path``, refused if larger than ``limit`` bytes."""
    with open_regular(path, what, follow=follow) as (f, size):
        if size > limit:
            raise UnsafeFileError(f"{what} {os.fspath(path)} is {size} bytes; such a file holds at most {limit}.")
        data = f.read(limit + 1)
    if len(data) > limit:  # it grew while being read
        raise UnsafeFileError(f"{what} {os.fspath(path)} is over {limit} bytes; such a file holds at most {limit}.")
    return data


def iter_lines(path: str | os.PathLike, what: str, *, max_line: int) -> Iterator[tuple[int, bytes]]:
    """``(line number, line)`` of a regular file, each line without its ``\\n``, read as a stream.

    A line longer than ``max_line`` bytes is an :class:`UnsafeFileError`: a file of one endless
    line (a sparse hole reads as zeros) is refused after ``max_line`` bytes, not read whole.
    """
    with open_regular(path, what) as (f, _):
        number = 0
        while True:
            line = f.readline(max_line + 1)
            if not line:
                return
            number += 1
            if len(line) > max_line and not line.endswith(b"\n"):
                raise UnsafeFileError(
                    f"{what} {os.fspath(path)} line {number} is longer than {max_line} bytes: it is not a line of this file."
                )
            yield number, line.rstrip(b"\n")


def open_in_place(path: str | os.PathLike, flags: int, what: str, *, mode: int = 0o644) -> int:
    """A descriptor of a run file written in place (``O_APPEND``, or the lock), created if absent.

    Refuses a symlink, anything not a regular file and a file with other hard links: a write
    through any of them would land outside the run directory.
    """
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except FileExistsError:
        fd = _open_fd(path, flags, what)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse(path, what, "a symbolic link") from None
        raise
    links = os.fstat(fd).st_nlink
    if links > 1:
        os.close(fd)
        raise UnsafeFileError(
            f"{what} {os.fspath(path)} has {links} hard links: writing it would change the same file elsewhere. "
            "Replace it by a copy (cp) of its own and try again."
        )
    return fd


def create_exclusive(directory: str | os.PathLike, name: str) -> tuple[int, str]:
    """A new temporary file in ``directory`` (``mkstemp``: ``O_EXCL``, mode 0600): ``(fd, path)``."""
    return tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)


def replace_with_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to a new file beside ``path``, fsync it and rename it into place.

    The rename replaces whatever ``path`` is (a symlink included) and writes nothing elsewhere.
    """
    path = Path(path)
    fd, tmp = create_exclusive(path.parent, path.name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def check_directory(path: str | os.PathLike, what: str) -> None:
    """Refuse ``path`` if it exists and is not a directory of its own (a symlink to one included)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeFileError(
            f"{what} {os.fspath(path)} is {_kind(info.st_mode)}, not a directory of the run: what is written "
            "there would land elsewhere. Remove it and try again."
        )


def _address_space_left() -> int | None:
    """Bytes of address space this process may still map under ``RLIMIT_AS`` (None: no limit)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    import psutil

    return max(0, soft - psutil.Process().memory_info().vms)


def memory_left() -> int:
    """Bytes this process can still have: the machine's available memory, or less under ``RLIMIT_AS``."""
    import psutil

    left = psutil.virtual_memory().available
    limit = _address_space_left()
    return left if limit is None else min(left, limit)


def check_affordable(nbytes: int, path: str | os.PathLike, what: str) -> None:
    """Refuse to read ``nbytes`` declared by ``path`` when this process cannot hold them.

    A file's header can declare any size; reading it whole would then exhaust memory (a
    sparse file costs nothing on disk). Twice the size must fit: the bytes and what is
    decoded from them.
    """
    left = memory_left()
    if 2 * nbytes > left:
        raise UnsafeFileError(
            f"{what} {os.fspath(path)} declares {nbytes} bytes, more than this process can hold "
            f"({left} bytes free): it is not a file this machine can load."
        )


# ------------------------------------------------------------------------- headed files
def previous_path(path: Path) -> Path:
    """``checkpoint.pt`` -> ``checkpoint.prev.pt``, ``env_state.pkl`` -> ``env_state.prev.pkl``."""
    return path.with_name(path.stem + ".prev" + path.suffix)


def fsync_dir(directory: Path) -> None:
    """fsync a directory (a rename in it is then on disk)."""
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


def write_atomic(path: Path, header: bytes, data: bytes | memoryview, check: Callable[[Path], Any]) -> None:
    """Write ``header + data`` to a temporary file, fsync, ``check`` it, keep the old ``path``
    as its previous file and rename the new one into place. Nothing is left behind on failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = create_exclusive(path.parent, path.name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        check(Path(tmp))  # what is on disk is what we meant to write
        if is_regular(path):  # (a symlink or other odd entry is replaced, never kept or followed)
            # Keep the current file as the previous one. A hard link leaves ``path`` in
            # place, so at every moment there is a file under the usual name.
            link = Path(tmp + ".prev")
            try:
                os.link(path, link, follow_symlinks=False)
            except OSError:  # file systems without hard links
                import shutil

                shutil.copy2(path, link, follow_symlinks=False)
            os.replace(link, previous_path(path))
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        for leftover in (tmp, tmp + ".prev"):
            if os.path.exists(leftover):
                os.unlink(leftover)
        raise


def header_fields(line: bytes, magic: bytes, shown: Path, what: str) -> dict[str, str]:
    """``key=value`` fields of a header ``line`` after ``magic``; one-line CheckpointError if unreadable."""
    try:
        return dict(part.split("=", 1) for part in line[len(magic) :].decode().split())
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(f"{what} {shown} is corrupt: its header is unreadable.") from None


def read_payload(f: Any, size: int, line: bytes, fields: dict[str, str], shown: Path, what: str) -> bytes:
    """The payload after the header ``line`` of the open file ``f`` (``size`` bytes in all), read
    only once the file's size matches the size the header declares, then checked by sha256."""
    try:
        digest, expected = fields["sha256"], int(fields["size"])
    except (KeyError, ValueError):
        raise CheckpointError(f"{what} {shown} is corrupt: its header is unreadable.") from None
    found = size - len(line)
    if found != expected:
        raise CheckpointError(f"{what} {shown} is truncated or padded: {found} payload bytes instead of {expected}.")
    check_affordable(expected, shown, what)
    data = f.read(expected)
    if len(data) != expected or f.read(1):
        raise CheckpointError(f"{what} {shown} changed while it was read; try again.")
    if hashlib.sha256(data).hexdigest() != digest:
        raise CheckpointError(f"{what} {shown} is corrupt: its sha256 checksum does not match its contents.")
    return data
