"""Which files this user wrote: a per-user secret and HMAC-SHA256 over what must not be taken
from anyone else.

A run directory may come from someone else; reading its weights executes nothing
(:mod:`rl_replay.run.safe_tree`). The environment state of a checkpoint (the sync sub-envs with
their wrappers and RNGs) can only be a pickle, and unpickling runs whatever the pickle names.
So it is unpickled only when it carries a MAC made with *this user's* secret: a file that
this user's runs wrote. A file from another user or machine, or one changed after it was
written, fails the check (a checksum cannot tell: whoever changes the file can rewrite it).
A run's ``config.yaml`` is signed the same way, under its own purpose: it names code by import
path, and only a config this user's runs wrote may import modules outside rl_replay and
gymnasium (:mod:`rl_replay.run.run_config`).

The secret is 32 random bytes, created on first use as ``<config dir>/rl_replay/secret.key``
with permissions 0600 (in a 0700 directory); the config directory is ``$XDG_CONFIG_HOME``, or
``~/.config``. ``RL_REPLAY_CONFIG_DIR`` names the ``rl_replay`` directory itself (tests, or
a cluster whose home is not shared). Jupyter trusts notebooks the same way.
"""

from __future__ import annotations

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


def _read(path: Path) -> bytes:
    info = path.stat()
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SetupError(
            f"{path} is readable by other users (mode {stat.S_IMODE(info.st_mode):04o}): anyone who can read it "
            f"can make a run directory this account trusts. Run: chmod 600 {path}"
        )
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise SetupError(f"{path} belongs to another user (uid {info.st_uid}); remove it to have a new one made.")
    key = bytes.fromhex(path.read_text().strip())
    if len(key) < 16:
        raise ValueError("too short")
    return key


def user_secret() -> bytes:
    """This user's secret, created (0600) on first use.

    Raises :class:`~rl_replay.errors.SetupError` (one line) if the file exists but is readable
    by others, belongs to another user or is unreadable, or if it cannot be created.
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
        raise SetupError(f"cannot read {path}: {exc.strerror or exc}.") from None
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(f".{SECRET_NAME}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # fails if another process made one first: then use theirs
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
        return _read(path)
    except OSError as exc:
        raise SetupError(
            f"cannot create the per-user secret {path}: {exc.strerror or exc}. Set "
            "RL_REPLAY_CONFIG_DIR to a private, writable directory."
        ) from None


def existing_secret() -> bytes | None:
    """This user's secret if it exists (None: nothing this user signed can exist); never creates it.

    Raises :class:`~rl_replay.errors.SetupError` as :func:`user_secret` for a secret file that
    others can read or that belongs to another user.
    """
    if not secret_path().exists():
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
