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
* **The directory is held by its descriptor** (:class:`Dir`): opened once, without following a
  link, and every file of it reached relative to that descriptor, so a directory swapped for a
  link mid-command moves no read or write elsewhere.

The checkpoint and env-state files are *headed*: one line ``MAGIC key=value ...`` naming the
payload's ``sha256`` and ``size``, then the payload. :meth:`Dir.write_atomic` writes one (keeping the
previous file), :func:`header_fields` and :func:`read_payload` read one back.

Every refusal is an :class:`UnsafeFileError` (a :class:`~rl_replay.errors.RunDirError`), one line.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import resource
import secrets
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from rl_replay.errors import CheckpointError, RunDirError

__all__ = [
    "UnsafeFileError",
    "Dir",
    "open_parent",
    "held",
    "located",
    "read_regular",
    "is_regular",
    "kind_of",
    "check_affordable",
    "memory_left",
    "HEADER_MAX",
    "previous_name",
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


def kind_of(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _refuse(path: str | os.PathLike, what: str, kind: str) -> UnsafeFileError:
    return UnsafeFileError(
        f"{what} {os.fspath(path)} is {kind}, not a regular file: a run directory holds regular files only. "
        "Remove it (or copy the run without it) and try again."
    )


class Dir:
    """A directory held by its descriptor; every file in it is reached relative to that descriptor.

    It is opened once (``O_DIRECTORY``, and for a run directory ``O_NOFOLLOW``), then each file
    is opened, created, renamed and removed with ``dir_fd``: swapping the directory's path for a
    symlink (or for another directory) after it was opened moves nothing, and what a command
    reads and writes stays in the directory it opened. ``path`` is for messages only.
    """

    def __init__(self, fd: int, path: str | os.PathLike) -> None:
        self.fd: int | None = fd
        self.path = Path(path)

    @classmethod
    def open(cls, path: str | os.PathLike, what: str = "run directory", *, follow: bool = False) -> Dir:
        """Open ``path`` as a directory (``follow``: the user named it and it may be a symlink).

        Raises FileNotFoundError if it does not exist and :class:`UnsafeFileError` (one line) if it
        is not a directory, or a symlink when ``follow`` is False.
        """
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafeFileError(
                    f"{what} {os.fspath(path)} is a symbolic link: a run directory is opened without following "
                    f"links. Give the directory itself ({os.path.realpath(path)})."
                ) from None
            if exc.errno == errno.ENOTDIR:
                if not follow and os.path.islink(path):  # (O_DIRECTORY meets the link before O_NOFOLLOW)
                    raise UnsafeFileError(
                        f"{what} {os.fspath(path)} is a symbolic link: a run directory is opened without "
                        f"following links. Give the directory itself ({os.path.realpath(path)})."
                    ) from None
                raise UnsafeFileError(f"{what} {os.fspath(path)} is not a directory.") from None
            raise
        return cls(fd, path)

    def close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)

    def __enter__(self) -> Dir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # (a Dir dropped unclosed must not leak its descriptor)
        with contextlib.suppress(Exception):
            self.close()

    def _fd(self) -> int:
        if self.fd is None:
            raise ValueError(f"directory {self.path} is closed")
        return self.fd

    def shown(self, name: str) -> Path:
        """``name`` as messages show it."""
        return self.path / name

    def lstat(self, name: str) -> os.stat_result | None:
        """``lstat`` of ``name`` (None if there is none)."""
        try:
            return os.stat(name, dir_fd=self._fd(), follow_symlinks=False)
        except FileNotFoundError:
            return None

    def exists(self, name: str) -> bool:
        """Whether an entry ``name`` exists (a dangling symlink included)."""
        return self.lstat(name) is not None

    def is_regular(self, name: str) -> bool:
        """Whether ``name`` itself (not what a symlink points to) is a regular file."""
        info = self.lstat(name)
        return info is not None and stat.S_ISREG(info.st_mode)

    def listdir(self) -> list[str]:
        return os.listdir(self._fd())

    def _open_fd(self, name: str, flags: int, what: str, *, follow: bool = False, mode: int = 0o644) -> int:
        """``os.open`` that refuses anything but a regular file (and, unless ``follow``, a symlink)."""
        display = self.shown(name)
        if not follow:
            info = self.lstat(name)
            if info is None:
                if not flags & os.O_CREAT:
                    raise FileNotFoundError(errno.ENOENT, "No such file or directory", os.fspath(display))
            elif not stat.S_ISREG(info.st_mode):
                raise _refuse(display, what, kind_of(info.st_mode))
        try:
            fd = os.open(
                name,
                flags | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW),
                mode,
                dir_fd=self._fd(),
            )
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink made after the lstat
                raise _refuse(display, what, "a symbolic link") from None
            if isinstance(exc, FileNotFoundError):
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", os.fspath(display)) from None
            raise
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise _refuse(display, what, kind_of(info.st_mode))
        os.set_blocking(fd, True)
        return fd

    @contextlib.contextmanager
    def open_regular(self, name: str, what: str, *, follow: bool = False) -> Iterator[tuple[BinaryIO, int]]:
        """``(file, size)`` of the regular file ``name`` opened for reading, closed on exit.

        ``what`` names the file in errors ("checkpoint"). ``follow`` lets a file the user named be
        a symlink (never a run directory's own files). Raises FileNotFoundError if it does not
        exist and :class:`UnsafeFileError` if it is not a regular file.
        """
        fd = self._open_fd(name, os.O_RDONLY, what, follow=follow)
        f = os.fdopen(fd, "rb")
        try:
            yield f, os.fstat(fd).st_size
        finally:
            f.close()

    def read_regular(self, name: str, what: str, *, limit: int, follow: bool = False) -> bytes:
        """The bytes of the regular file ``name``, refused if larger than ``limit`` bytes."""
        display = self.shown(name)
        with self.open_regular(name, what, follow=follow) as (f, size):
            if size > limit:
                raise UnsafeFileError(f"{what} {display} is {size} bytes; such a file holds at most {limit}.")
            data = f.read(limit + 1)
        if len(data) > limit:  # it grew while being read
            raise UnsafeFileError(f"{what} {display} is over {limit} bytes; such a file holds at most {limit}.")
        return data

    def iter_lines(self, name: str, what: str, *, max_line: int) -> Iterator[tuple[int, bytes]]:
        """``(line number, line)`` of a regular file, each line without its ``\\n``, read as a stream.

        A line longer than ``max_line`` bytes is an :class:`UnsafeFileError`: a file of one endless
        line (a sparse hole reads as zeros) is refused after ``max_line`` bytes, not read whole.
        """
        with self.open_regular(name, what) as (f, _):
            number = 0
            while True:
                line = f.readline(max_line + 1)
                if not line:
                    return
                number += 1
                if len(line) > max_line and not line.endswith(b"\n"):
                    raise UnsafeFileError(
                        f"{what} {self.shown(name)} line {number} is longer than {max_line} bytes: it is not a "
                        "line of this file."
                    )
                yield number, line.rstrip(b"\n")

    def open_in_place(self, name: str, flags: int, what: str, *, mode: int = 0o644) -> int:
        """A descriptor of a file written in place (``O_APPEND``, or the lock), created if absent.

        Refuses a symlink, anything not a regular file and a file with other hard links: a write
        through any of them would land outside the run directory.
        """
        try:
            fd = os.open(name, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self._fd())
        except FileExistsError:
            fd = self._open_fd(name, flags, what)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _refuse(self.shown(name), what, "a symbolic link") from None
            raise
        links = os.fstat(fd).st_nlink
        if links > 1:
            os.close(fd)
            raise UnsafeFileError(
                f"{what} {self.shown(name)} has {links} hard links: writing it would change the same file elsewhere. "
                "Replace it by a copy (cp) of its own and try again."
            )
        return fd

    def create_exclusive(self, name: str, *, suffix: str = ".tmp") -> tuple[int, str]:
        """A new file beside ``name`` (``O_EXCL``, no link followed, mode 0600): ``(fd, its name)``."""
        for _ in range(100):
            tmp = f".{name}.{secrets.token_hex(6)}{suffix}"
            try:
                fd = os.open(
                    tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self._fd()
                )
            except FileExistsError:
                continue
            return fd, tmp
        raise FileExistsError(errno.EEXIST, "no free temporary name", os.fspath(self.shown(name)))  # pragma: no cover

    def replace(self, src: str, dst: str) -> None:
        """Rename ``src`` over ``dst`` within this directory (a symlink at ``dst`` is replaced)."""
        os.replace(src, dst, src_dir_fd=self._fd(), dst_dir_fd=self._fd())

    def unlink(self, name: str, *, missing_ok: bool = False) -> None:
        try:
            os.unlink(name, dir_fd=self._fd())
        except FileNotFoundError:
            if not missing_ok:
                raise

    def fsync(self) -> None:
        """fsync the directory (a rename in it is then on disk)."""
        with contextlib.suppress(OSError):
            os.fsync(self._fd())

    def replace_with_text(self, name: str, text: str) -> None:
        """Write ``text`` to a new file beside ``name``, fsync it and rename it into place.

        The rename replaces whatever ``name`` is (a symlink included) and writes nothing elsewhere.
        """
        fd, tmp = self.create_exclusive(name)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            self.replace(tmp, name)
        except BaseException:
            self.unlink(tmp, missing_ok=True)
            raise

    def check_directory(self, name: str, what: str) -> None:
        """Refuse ``name`` if it exists and is not a directory of its own (a symlink to one included)."""
        info = self.lstat(name)
        if info is not None and not stat.S_ISDIR(info.st_mode):
            raise UnsafeFileError(
                f"{what} {self.shown(name)} is {kind_of(info.st_mode)}, not a directory of the run: what is written "
                "there would land elsewhere. Remove it and try again."
            )

    def _copy(self, src: str, dst: str) -> None:
        with self.open_regular(src, "file") as (f, _):
            out = os.open(
                dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self._fd()
            )
            with os.fdopen(out, "wb") as g:
                while chunk := f.read(1 << 20):
                    g.write(chunk)

    def write_atomic(self, name: str, header: bytes, data: bytes | memoryview, check: Callable[[str], Any]) -> None:
        """Write ``header + data`` to a temporary file, fsync, ``check`` it (given the temporary's
        name in this directory), keep the old ``name`` as its previous file and rename the new one
        into place. Nothing is left behind on failure."""
        fd, tmp = self.create_exclusive(name)
        link = tmp + ".prev"
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            check(tmp)  # what is on disk is what we meant to write
            if self.is_regular(name):  # (a symlink or other odd entry is replaced, never kept or followed)
                # Keep the current file as the previous one. A hard link leaves ``name`` in
                # place, so at every moment there is a file under the usual name.
                try:
                    os.link(name, link, src_dir_fd=self._fd(), dst_dir_fd=self._fd(), follow_symlinks=False)
                except OSError:  # file systems without hard links: a copy
                    self._copy(name, link)
                self.replace(link, previous_name(name))
            self.replace(tmp, name)
            self.fsync()
        except BaseException:
            for leftover in (tmp, link):
                self.unlink(leftover, missing_ok=True)
            raise


@contextlib.contextmanager
def held(where: Dir | str | os.PathLike) -> Iterator[Dir]:
    """``where`` itself if it is a held :class:`Dir`, else the directory at that path, opened (no
    link followed) for the block and closed after it."""
    if isinstance(where, Dir):
        yield where
    else:
        with Dir.open(where) as d:
            yield d


@contextlib.contextmanager
def located(where: Dir | str | os.PathLike, default: str, name: str | None = None) -> Iterator[tuple[Dir, str, bool]]:
    """``(directory, file name, user_named)`` of a run file given as a held run directory (``name``
    in it, else ``default``), a run directory's path, or the path of a file the user named (whose
    directory may be reached through links, and which may be a link itself: ``user_named``). A
    directory opened here is closed on exit."""
    if isinstance(where, Dir):
        yield where, name or default, False
        return
    path = Path(where)
    if name is None and path.is_dir():
        with Dir.open(path) as d:
            yield d, default, False
        return
    d, leaf = open_parent(path / name if name else path)
    with d:
        yield d, leaf, name is None


def open_parent(path: str | os.PathLike) -> tuple[Dir, str]:
    """``(the directory of path, its name)`` for a file the user named (its directory may be reached
    through links); close the Dir when done."""
    path = Path(path)
    return Dir.open(path.parent, "directory", follow=True), path.name


def is_regular(path: str | os.PathLike) -> bool:
    """Whether ``path`` itself (not what a symlink points to) is a regular file."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def read_regular(path: str | os.PathLike, what: str, *, limit: int, follow: bool = False) -> bytes:
    """:meth:`Dir.read_regular` of a file named by its path."""
    d, name = open_parent(path)
    with d:
        return d.read_regular(name, what, limit=limit, follow=follow)


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
def previous_name(name: str) -> str:
    """``checkpoint.pt`` -> ``checkpoint.prev.pt``, ``env_state.pkl`` -> ``env_state.prev.pkl``."""
    stem, dot, suffix = name.rpartition(".")
    return f"{stem}.prev.{suffix}" if dot else f"{name}.prev"


def header_fields(line: bytes, magic: bytes, display: Path, what: str) -> dict[str, str]:
    """``key=value`` fields of a header ``line`` after ``magic``; one-line CheckpointError if unreadable."""
    try:
        return dict(part.split("=", 1) for part in line[len(magic) :].decode().split())
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(f"{what} {display} is corrupt: its header is unreadable.") from None


def read_payload(f: Any, size: int, line: bytes, fields: dict[str, str], display: Path, what: str) -> bytes:
    """The payload after the header ``line`` of the open file ``f`` (``size`` bytes in all), read
    only once the file's size matches the size the header declares, then checked by sha256."""
    try:
        digest, expected = fields["sha256"], int(fields["size"])
    except (KeyError, ValueError):
        raise CheckpointError(f"{what} {display} is corrupt: its header is unreadable.") from None
    found = size - len(line)
    if found != expected:
        raise CheckpointError(f"{what} {display} is truncated or padded: {found} payload bytes instead of {expected}.")
    check_affordable(expected, display, what)
    data = f.read(expected)
    if len(data) != expected or f.read(1):
        raise CheckpointError(f"{what} {display} changed while it was read; try again.")
    if hashlib.sha256(data).hexdigest() != digest:
        raise CheckpointError(f"{what} {display} is corrupt: its sha256 checksum does not match its contents.")
    return data
