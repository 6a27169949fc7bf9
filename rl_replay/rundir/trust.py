"""Which files this user wrote: a per-user secret and HMAC-SHA256 over what must not be taken
from anyone else.

A run directory may come from someone else; reading its weights executes nothing
(:mod:`rl_replay.rundir.safe_tree`). The environment state of a checkpoint (the sync sub-envs with
their wrappers and RNGs) can only be a pickle, and unpickling runs whatever the pickle names.
So it is unpickled only when it carries a MAC made with *this user's* secret: a file that
this user's runs wrote. A file from another user or machine, or one changed after it was
written, fails the check (a checksum cannot tell: whoever changes the file can rewrite it).
A run's ``config.yaml`` is signed the same way, under its own purpose: it names code by import
path, and only a config this user's runs wrote may import modules outside rl_replay and
gymnasium (:mod:`rl_replay.rundir.config_file`).

The secret is 32 random bytes, created on first use as ``<config dir>/rl_replay/secret.key``
with permissions 0600 (in a 0700 directory); the config directory is ``$XDG_CONFIG_HOME``, or
``~/.config``. As ssh requires of ``~/.ssh``, the folder must be this user's and writable by
no one else (whoever can write it chooses the key), and the secret a small regular file of
this user's that no one else can read. It is read from the descriptor those checks were made
on (no link followed), and created as a fresh exclusive temporary linked to its name, never
written through a path that exists. ``RL_REPLAY_CONFIG_DIR`` names the ``rl_replay`` directory itself (tests, or
a cluster whose home is not shared). Jupyter trusts notebooks the same way.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from rl_replay.errors import SetupError

__all__ = ["config_dir", "secret_path", "user_secret", "existing_secret", "fingerprint", "sign", "verify"]

SECRET_NAME = "secret.key"
# Keeps this key's MACs for one purpose apart from any other: an env-state MAC is no config MAC.
_DOMAINS = {"env-state": b"rl_replay env-state v1\0", "config": b"rl_replay config v1\0"}


def config_dir() -> Path:
    """The directory holding rl_replay's per-user files (not created here)."""
    explicit = os.environ.get("RL_REPLAY_CONFIG_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "rl_replay"


def secret_path() -> Path:
    """Where this user's secret lives."""
    return config_dir() / SECRET_NAME


#: The largest secret file read (64 hex digits and a newline; the rest is room for editors).
SECRET_MAX = 256


def _check_folder(folder: Path) -> None:
    """Refuse a secret's folder that another user could change, as ssh refuses such a ``~/.ssh``.

    Whoever can write the folder can put their own key in it (or swap the folder itself, which
    then belongs to them), and a config they sign with that key would import code here.
    """
    try:
        info = os.lstat(folder)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        raise SetupError(
            f"the folder of the per-user secret {folder} is a symbolic link: whoever controls where it points "
            f"controls which runs this account trusts. Replace it by a directory of your own (mkdir -m 700 {folder})."
        )
    if not stat.S_ISDIR(info.st_mode):
        raise SetupError(f"the folder of the per-user secret {folder} is not a directory; remove it to have one made.")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise SetupError(
            f"the folder of the per-user secret {folder} belongs to another user (uid {info.st_uid}): they could "
            "choose the key this account trusts. Point RL_REPLAY_CONFIG_DIR at a folder of your own."
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise SetupError(
            f"the folder of the per-user secret {folder} is writable by other users (mode "
            f"{stat.S_IMODE(info.st_mode):04o}): they could choose the key this account trusts. Run: chmod 700 {folder}"
        )


def _read(path: Path) -> bytes:
    """The key in ``path``, read from the descriptor whose kind, owner, mode and size were checked."""
    _check_folder(path.parent)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)  # ELOOP on a symlink
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SetupError(f"{path} is not a regular file; remove it to have a new secret made.")
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SetupError(
                f"{path} is readable by other users (mode {stat.S_IMODE(info.st_mode):04o}): anyone who can read it "
                f"can make a run directory this account trusts. Run: chmod 600 {path}"
            )
        if hasattr(os, "getuid") and info.st_uid != os.getuid():
            raise SetupError(f"{path} belongs to another user (uid {info.st_uid}); remove it to have a new one made.")
        if info.st_size > SECRET_MAX:
            raise SetupError(
                f"{path} is {info.st_size} bytes, not a secret (64 hex digits); remove it to have one made."
            )
        os.set_blocking(fd, True)
        text = os.read(fd, SECRET_MAX + 1)
    finally:
        os.close(fd)
    key = bytes.fromhex(text.decode("ascii").strip())
    if len(key) < 16 or len(text) > SECRET_MAX:
        raise ValueError("not a secret")
    return key


def _create(path: Path) -> None:
    """Make a new secret at ``path`` unless one appears first: a fresh temporary created exclusively
    (no link followed, mode 0600), fsynced, then linked to its name (which fails if taken)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_folder(path.parent)
    for _ in range(100):
        tmp = path.with_name(f".{SECRET_NAME}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            continue
        break
    else:  # pragma: no cover - 100 random names taken
        raise FileExistsError(f"no free temporary name in {path.parent}")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # never through an existing path: fails if another process made one first
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)


def user_secret() -> bytes:
    """This user's secret, created (0600, in a folder only this user can write) on first use.

    Raises :class:`~rl_replay.errors.SetupError` (one line) if the folder is not this user's alone
    (another owner, writable by group or others, a symlink), if the file exists but is not a small
    regular file of this user's that only they can read, or if it cannot be created.
    """
    path = secret_path()
    try:
        return _read(path)
    except FileNotFoundError:
        pass
    except SetupError:  # (a ValueError too)
        raise
    except (ValueError, UnicodeDecodeError):
        raise SetupError(f"{path} does not hold a secret (64 hex digits); remove it to have a new one made.") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SetupError(
                f"{path} is a symbolic link: the secret must be a file of its own. Remove the link to have one made."
            ) from None
        raise SetupError(f"cannot read {path}: {exc.strerror or exc}.") from None
    try:
        _create(path)
        return _read(path)
    except SetupError:
        raise
    except (ValueError, UnicodeDecodeError):
        raise SetupError(f"{path} does not hold a secret (64 hex digits); remove it to have a new one made.") from None
    except OSError as exc:
        raise SetupError(
            f"cannot create the per-user secret {path}: {exc.strerror or exc}. Set "
            "RL_REPLAY_CONFIG_DIR to a private, writable directory."
        ) from None


def existing_secret() -> bytes | None:
    """This user's secret if it exists (None: nothing this user signed can exist); never creates it.

    Raises :class:`~rl_replay.errors.SetupError` as :func:`user_secret` for a secret, or a folder,
    that others could have chosen.
    """
    path = secret_path()
    _check_folder(path.parent)
    if not os.path.lexists(path):
        return None
    return user_secret()


def fingerprint(key: bytes) -> str:
    """A short public name of ``key`` (tells whose key signed a file; reveals nothing of it)."""
    return hashlib.sha256(b"rl_replay key id\0" + key).hexdigest()[:16]


def sign(data: bytes | memoryview, key: bytes, purpose: str = "env-state") -> str:
    """HMAC-SHA256 of ``data`` under ``key`` for ``purpose`` (``env-state`` or ``config``), in hex."""
    return hmac.new(key, _DOMAINS[purpose] + bytes(data), hashlib.sha256).hexdigest()


def verify(data: bytes | memoryview, mac: object, key: bytes, purpose: str = "env-state") -> bool:
    """Whether ``mac`` is :func:`sign` of ``data`` under ``key`` (compared in constant time).

    ``mac`` comes from a file: anything but 64 hex digits (another type, non-ASCII text) is False.
    """
    if not (isinstance(mac, str) and len(mac) == 64 and all(c in "0123456789abcdef" for c in mac)):
        return False
    return hmac.compare_digest(sign(data, key, purpose).encode(), mac.encode())
