"""Checkpoint files that run no code when read, are written atomically and are never lost.

A checkpoint is two files (docs/operations.md, "Sharing runs"):

* ``checkpoint.pt``: one header line, then a `safetensors` file holding every number of the
  run (weights, optimizer, counters, RNG states, collector arrays) with the tree's shape as
  JSON (:mod:`rl_replay.run.safe_tree`)::

      RLREPLAY-CHECKPOINT 2 sha256=<64 hex digits> size=<payload bytes>\\n
      <safetensors bytes>

  Reading it runs safetensors and json only, so a run directory from anyone can be
  evaluated or warm-started from.
* ``env_state.pkl`` (only for sync envs that pickle): the sub-envs pickled whole, which a
  resume needs to continue exactly. Its header adds an HMAC-SHA256 made with this user's
  secret (:mod:`rl_replay.run.trust`)::

      RLREPLAY-ENVSTATE 1 sha256=<hex> size=<bytes> key=<key id> hmac-sha256=<hex>\\n
      <safetensors bytes: one pickle per rank, as uint8>

  :func:`read_env_state` returns the pickles only when the MAC verifies (or the caller says it
  trusts the file); unpickling them is the resume's business. The checkpoint names the sha256
  of the env-state payload it belongs to, so a pair cut apart by a kill is never mixed.

Both are written the same way: to a temporary file in the same directory, fsynced, read back
and checked, the old file kept as ``<name>.prev<suffix>`` (``checkpoint.prev.pt``), then
renamed into place (``os.replace`` is atomic on POSIX). Loading opens a regular file only (no
symlink, FIFO or device: :mod:`rl_replay.run.files`), compares the file's size with the size its
header declares *before* reading the payload, reads exactly that many bytes (refused if this
process cannot hold them), checks the sha256 and raises a one-line
:class:`~rl_replay.errors.CheckpointError` naming the file for an empty, truncated, padded,
corrupt or foreign one; :func:`load_latest` falls back to the previous checkpoint.

Older checkpoints (format 1, or a bare ``torch.save``) are pickles: they are refused with the
command that converts one whose origin the user trusts (:func:`convert_legacy`).
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rl_replay._compat import current_agent_keys
from rl_replay.errors import CheckpointError, one_line, shown
from rl_replay.run import files, safe_tree, trust

__all__ = [
    "CHECKPOINT_NAME",
    "PREVIOUS_NAME",
    "ENV_STATE_NAME",
    "save_checkpoint",
    "load_checkpoint",
    "load_latest",
    "checkpoint_path",
    "previous_checkpoint_path",
    "remove_stale_temporaries",
    "capture_rng",
    "restore_rng",
    "check_rng",
    "non_finite_tensors",
    "require",
    "require_counts",
    "load_agent_weights",
    "save_env_state",
    "read_env_state",
    "EnvState",
    "convert_legacy",
    "CONVERT_COMMAND",
]

CHECKPOINT_NAME = "checkpoint.pt"
PREVIOUS_NAME = "checkpoint.prev.pt"
ENV_STATE_NAME = "env_state.pkl"
FORMAT = 2
_MAGIC = b"RLREPLAY-CHECKPOINT "
_ENV_MAGIC = b"RLREPLAY-ENVSTATE 1 "
_HEADER_MAX = 512
CONVERT_COMMAND = "python scripts/convert_checkpoint.py {path} --trust"


def checkpoint_path(run_dir: str | os.PathLike) -> Path:
    """Where a run keeps its latest checkpoint."""
    return Path(run_dir) / CHECKPOINT_NAME


def previous_checkpoint_path(run_dir: str | os.PathLike) -> Path:
    """Where a run keeps the checkpoint before the latest one."""
    return Path(run_dir) / PREVIOUS_NAME


def _previous(path: Path) -> Path:
    """``checkpoint.pt`` -> ``checkpoint.prev.pt``, ``env_state.pkl`` -> ``env_state.prev.pkl``."""
    return path.with_name(path.stem + ".prev" + path.suffix)


# ------------------------------------------------------------------------- finite weights
def non_finite_tensors(state: dict[str, Any]) -> list[str]:
    """Names of the floating-point tensors in ``state`` holding NaN or infinity."""
    return [
        name
        for name, t in state.items()
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]


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


# ------------------------------------------------------------------------ file primitives
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


def _write_atomic(path: Path, header: bytes, data: bytes | memoryview, check: Callable[[Path], Any]) -> None:
    """Write ``header + data`` to a temporary file, fsync, ``check`` it, keep the old ``path``
    as its previous file and rename the new one into place. Nothing is left behind on failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        check(Path(tmp))  # what is on disk is what we meant to write
        if files.is_regular(path):  # (a symlink or other odd entry is replaced, never kept or followed)
            # Keep the current file as the previous one. A hard link leaves ``path`` in
            # place, so at every moment there is a file under the usual name.
            link = Path(tmp + ".prev")
            try:
                os.link(path, link, follow_symlinks=False)
            except OSError:  # file systems without hard links
                import shutil

                shutil.copy2(path, link, follow_symlinks=False)
            os.replace(link, _previous(path))
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        for leftover in (tmp, tmp + ".prev"):
            if os.path.exists(leftover):
                os.unlink(leftover)
        raise


def _fields(line: bytes, magic: bytes, shown: Path, what: str) -> dict[str, str]:
    try:
        return dict(part.split("=", 1) for part in line[len(magic) :].decode().split())
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(f"{what} {shown} is corrupt: its header is unreadable.") from None


def _read_payload(f: Any, size: int, line: bytes, fields: dict[str, str], shown: Path, what: str) -> bytes:
    """The payload after the header ``line`` of the open file ``f`` (``size`` bytes in all), read
    only once the file's size matches the size the header declares, then checked by sha256."""
    try:
        digest, expected = fields["sha256"], int(fields["size"])
    except (KeyError, ValueError):
        raise CheckpointError(f"{what} {shown} is corrupt: its header is unreadable.") from None
    found = size - len(line)
    if found != expected:
        raise CheckpointError(f"{what} {shown} is truncated or padded: {found} payload bytes instead of {expected}.")
    files.check_affordable(expected, shown, what)
    data = f.read(expected)
    if len(data) != expected or f.read(1):
        raise CheckpointError(f"{what} {shown} changed while it was read; try again.")
    if hashlib.sha256(data).hexdigest() != digest:
        raise CheckpointError(f"{what} {shown} is corrupt: its sha256 checksum does not match its contents.")
    return data


def _legacy_error(path: Path, kind: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} is {kind}: a pickle, which can run any code when loaded, so it is not loaded. "
        f"If you trust where it came from, convert it: {CONVERT_COMMAND.format(path=path)}"
    )


def _is_bare_torch_save(head: bytes) -> bool:
    # torch.save writes a zip archive (PK\x03\x04) or, with the legacy serializer, a pickle (0x80).
    return head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"


def _read_checkpoint_bytes(path: Path, *, shown: Path | None = None, follow: bool = False) -> bytes:
    """The verified safetensors payload of a format-2 checkpoint (``follow``: ``path`` was named
    by the user and may be a symlink; a run directory's own file may not)."""
    shown = shown or path
    with files.open_regular(path, "checkpoint", follow=follow) as (f, size):
        if size == 0:
            raise CheckpointError(f"checkpoint {shown} is empty (0 bytes): it was cut off while being written.")
        head = f.read(len(_MAGIC))
        if head != _MAGIC:
            if _is_bare_torch_save(head):
                raise _legacy_error(shown, "a bare torch.save file (no header)")
            raise CheckpointError(f"{shown} is not an rl_replay checkpoint (it does not start with its header).")
        line = head + f.readline(_HEADER_MAX)
        version, _, rest = line[len(_MAGIC) :].partition(b" ")
        if version == b"1":
            raise _legacy_error(shown, "in the format-1 layout")
        if version != str(FORMAT).encode():
            raise CheckpointError(
                f"checkpoint {shown} has format {one_line(version.decode(errors='replace'))[:20]!r}, which this "
                f"version of rl_replay does not read (it reads format {FORMAT}); upgrade rl_replay."
            )
        fields = _fields(b" " + rest, b"", shown, "checkpoint")
        return _read_payload(f, size, line, fields, shown, "checkpoint")


# ---------------------------------------------------------------------------- checkpoints
def save_checkpoint(payload: dict[str, Any], path: str | os.PathLike) -> None:
    """Verify, write and rename ``payload`` into ``path``; keep the old file as the previous one.

    ``payload`` is a tree :mod:`rl_replay.run.safe_tree` stores (no arbitrary objects). Raises
    :class:`CheckpointError` (and writes nothing) if ``payload["agent"]`` holds a non-finite
    tensor: a diverged model must never replace the last good checkpoint.
    """
    path = Path(path)
    bad = non_finite_tensors(payload.get("agent", {}))
    if bad:
        raise CheckpointError(
            f"refusing to write {path}: agent weights {', '.join(bad[:4])}"
            f"{' ...' if len(bad) > 4 else ''} are not finite; the previous checkpoint is kept."
        )
    data = safe_tree.dumps(payload, {"format": f"rl_replay-checkpoint-{FORMAT}"})
    header = _MAGIC + f"{FORMAT} sha256={hashlib.sha256(data).hexdigest()} size={len(data)}\n".encode()
    _write_atomic(path, header, data, lambda tmp: _read_checkpoint_bytes(tmp, shown=path))


def _decode(data: bytes, path: Path) -> dict[str, Any]:
    try:
        state, _ = safe_tree.loads(data)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read: {exc}.") from None
    if not isinstance(state, dict) or not isinstance(state.get("agent"), dict):
        raise CheckpointError(f"{path} is not an rl_replay checkpoint (it holds no agent weights).")
    odd = [k for k, v in state["agent"].items() if not isinstance(v, torch.Tensor)]
    if odd:
        raise CheckpointError(
            f"checkpoint {path} is not an rl_replay checkpoint: its agent entries "
            f"{', '.join(map(repr, odd[:4]))} are not tensors."
        )
    return state


def load_checkpoint(path: str | os.PathLike, *, follow: bool = False) -> dict[str, Any]:
    """Load and verify a checkpoint (a file, or a run directory's latest) onto the CPU.

    Runs no code from the file. Raises FileNotFoundError if it does not exist,
    :class:`~rl_replay.run.files.UnsafeFileError` if it is not a regular file (a symlink too,
    unless ``follow``: a file the user named, not a run directory's) and :class:`CheckpointError`
    (one line, naming the file) if it is empty, truncated, corrupt, not a checkpoint, or a
    legacy pickle (with the command that converts a trusted one).
    """
    path = Path(path)
    if path.is_dir():
        path, follow = checkpoint_path(path), False
    if not os.path.lexists(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    return _decode(_read_checkpoint_bytes(path, follow=follow), path)


def require(state: dict[str, Any], path: str | os.PathLike, keys: Iterable[str], needed_for: str) -> None:
    """One-line CheckpointError naming ``path`` and the entries of ``keys`` that ``state`` lacks."""
    missing = [k for k in keys if k not in state]
    if missing:
        raise CheckpointError(
            f"checkpoint {path} lacks {', '.join(repr(k) for k in missing)}, which "
            f"{needed_for} needs: it was not written by rl_replay's trainer."
        )


def require_counts(state: dict[str, Any], path: str | os.PathLike, keys: Iterable[str]) -> None:
    """One-line CheckpointError unless each of ``keys`` in ``state`` is a non-negative integer."""
    bad = [k for k in keys if not (isinstance(state.get(k), int) and not isinstance(state[k], bool) and state[k] >= 0)]
    if bad:
        raise CheckpointError(
            f"checkpoint {path} holds {', '.join(f'{k}={shown(state.get(k))}' for k in bad)}: counters must be "
            "non-negative integers, so it was not written by rl_replay's trainer."
        )


def load_agent_weights(agent: torch.nn.Module, weights: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """``agent.load_state_dict(weights)``; a mismatch is one CheckpointError line naming ``path``
    and the keys that are missing, unexpected or of another shape."""
    own = agent.state_dict()
    weights = current_agent_keys(weights, own)
    missing = [k for k in own if k not in weights]
    unexpected = [k for k in weights if k not in own]
    shapes = [
        f"{k} {tuple(weights[k].shape)} vs {tuple(own[k].shape)}"
        for k in own
        if k in weights and weights[k].shape != own[k].shape
    ]

    def few(names: list[str]) -> str:
        return ", ".join(names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")

    problems = (
        ([f"missing {few(missing)}"] if missing else [])
        + ([f"unexpected {few(unexpected)}"] if unexpected else [])
        + ([f"other shapes: {few(shapes)}"] if shapes else [])
    )
    if problems:
        raise CheckpointError(
            f"checkpoint {path} does not fit the agent its config.yaml builds "
            f"({'; '.join(problems)}): the checkpoint is not of this run's agent."
        )
    agent.load_state_dict(weights)


def load_latest(run_dir: str | os.PathLike) -> tuple[dict[str, Any], Path, str | None]:
    """The run's latest readable checkpoint: ``(state, path, warning)``.

    Falls back to ``checkpoint.prev.pt`` when ``checkpoint.pt`` is missing or damaged;
    ``warning`` then says so (None otherwise). Raises the latest file's error if neither loads.
    """
    latest, previous = checkpoint_path(run_dir), previous_checkpoint_path(run_dir)
    try:
        return load_checkpoint(latest), latest, None
    except (CheckpointError, FileNotFoundError) as exc:
        if not os.path.lexists(previous):
            raise
        try:
            state = load_checkpoint(previous)
        except CheckpointError:
            raise exc from None
        return (
            state,
            previous,
            f"{exc} Resuming from the previous checkpoint {previous} (update {state.get('update')}).",
        )


# -------------------------------------------------------------------------- env-state file
def save_env_state(pickles: list[bytes | None], run_dir: str | os.PathLike, key: bytes) -> str:
    """Write the per-rank env pickles as ``run_dir/env_state.pkl`` with a MAC under ``key``.

    Returns the sha256 of the payload, which the checkpoint records to name its env state.
    """
    path = Path(run_dir) / ENV_STATE_NAME
    data = safe_tree.dumps(list(pickles), {"format": "rl_replay-env-state-1"})
    digest = hashlib.sha256(data).hexdigest()
    header = (
        _ENV_MAGIC
        + (
            f"sha256={digest} size={len(data)} key={trust.fingerprint(key)} hmac-sha256={trust.sign(data, key)}\n"
        ).encode()
    )
    _write_atomic(path, header, data, lambda tmp: _read_env_file(tmp, shown=path))
    return digest


def _read_env_file(path: Path, *, shown: Path | None = None) -> tuple[dict[str, str], bytes]:
    shown = shown or path
    with files.open_regular(path, "env state") as (f, size):
        head = f.read(len(_ENV_MAGIC))
        if head != _ENV_MAGIC:
            raise CheckpointError(f"env state {shown} is not an rl_replay env-state file.")
        line = head + f.readline(_HEADER_MAX)
        fields = _fields(line, _ENV_MAGIC, shown, "env state")
        return fields, _read_payload(f, size, line, fields, shown, "env state")


class EnvState:
    """What :func:`read_env_state` found: ``pickles`` (one per rank) or None, and ``note``: why
    they are not given (None when they are), or the risk taken when trusted against the MAC."""

    def __init__(self, pickles: list[bytes | None] | None, note: str | None = None) -> None:
        self.pickles, self.note = pickles, note


def read_env_state(run_dir: str | os.PathLike, digest: str, key: bytes, *, trust_file: bool = False) -> EnvState:
    """The env pickles a checkpoint names (by payload sha256 ``digest``), if they may be unpickled.

    They are returned when the file's HMAC verifies under ``key`` (this user wrote it), or,
    with ``trust_file``, whatever the MAC says (``note`` then names the risk). Otherwise
    ``pickles`` is None and ``note`` says why: no such file, damaged, written by another
    user or machine, or changed after it was written. Nothing here unpickles.
    """
    latest = Path(run_dir) / ENV_STATE_NAME
    problems = []
    for path in (latest, _previous(latest)):
        if not os.path.lexists(path):
            continue
        try:
            fields, data = _read_env_file(path)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        if fields.get("sha256") != digest:
            continue
        mine = fields.get("key") == trust.fingerprint(key)
        if trust.verify(data, fields.get("hmac-sha256", ""), key, "env-state"):
            note = None
        else:
            why = (
                "changed after it was written (its MAC does not verify with this user's key)"
                if mine
                else f"written by another user or machine (signed with key {one_line(fields.get('key', '?'))[:32]}, this user's "
                f"is {trust.fingerprint(key)} in {trust.secret_path()})"
            )
            if not trust_file:
                return EnvState(None, f"{path} was not unpickled: it was {why}")
            note = (
                f"--trust-env-state: unpickling {path}, which was {why}; a pickle can run any code, "
                "so this trusts whoever wrote it"
            )
        try:
            pickles, _ = safe_tree.loads(data)
        except ValueError as exc:
            return EnvState(None, f"{path} cannot be read ({exc})")
        if not isinstance(pickles, list) or not all(p is None or isinstance(p, bytes) for p in pickles):
            return EnvState(None, f"{path} does not hold env pickles")
        return EnvState(pickles, note)
    detail = f" ({problems[0]})" if problems else ""
    return EnvState(None, f"no env-state file of this checkpoint in {run_dir}{detail}")


# --------------------------------------------------------------------------- legacy files
def convert_legacy(path: str | os.PathLike, *, trust_file: bool, key: bytes) -> tuple[Path, Path | None]:
    """Rewrite a legacy (pickled) checkpoint as format 2; returns ``(checkpoint, kept original)``.

    Unpickles the file, so it runs whatever the file names: only with ``trust_file``. A run
    directory's ``checkpoint.pt`` and ``checkpoint.prev.pt`` are converted in place (each
    original kept as ``<name>.legacy``); the env pickles go to ``env_state.pkl``, signed with
    ``key``. A file that is already format 2 is left alone.
    """
    path = Path(path)
    if path.is_dir():
        path = checkpoint_path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        _read_checkpoint_bytes(path)
        return path, None  # already format 2
    except CheckpointError as exc:
        if "a pickle" not in str(exc):
            raise
    if not trust_file:
        raise CheckpointError(
            f"converting {path} unpickles it, which runs any code it names: pass --trust "
            "if you trust where it came from."
        )
    raw = path.read_bytes()
    if raw.startswith(_MAGIC):
        line, _, data = raw.partition(b"\n")
        fields = _fields(line, _MAGIC + b"1 ", path, "checkpoint")
        if fields.get("size") != str(len(data)) or fields.get("sha256") != hashlib.sha256(data).hexdigest():
            raise CheckpointError(f"checkpoint {path} is corrupt: its size or sha256 does not match its header.")
    else:
        data = raw
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(exc).__name__}: {exc}).") from None
    if not isinstance(state, dict) or "agent" not in state:
        raise CheckpointError(f"{path} is not an rl_replay checkpoint.")
    if "collector" in state and "world_size" not in state:  # single-process files before FSDP
        state = dict(
            state,
            world_size=1,
            collector=[state["collector"]],
            rng=[state["rng"]],
            recent_returns=[state["recent_returns"]],
        )
    pickles = [c.pop("envs", None) if isinstance(c, dict) else None for c in state.get("collector", [])]
    if any(p is not None for p in pickles):
        state["env_state"] = save_env_state(pickles, path.parent, key)
    kept = path.with_name(path.name + ".legacy")
    os.replace(path, kept)
    try:
        save_checkpoint(state, path)
    except BaseException:
        os.replace(kept, path)
        raise
    return path, kept


def remove_stale_temporaries(run_dir: str | os.PathLike) -> list[Path]:
    """Delete temporary files left by a checkpoint (or env state, config, metrics) write that was killed.

    Returns the files removed. Call it only while holding the run directory's lock (no
    other writer is active).
    """
    removed = []
    patterns = (
        ".checkpoint*.tmp*",
        ".env_state*.tmp*",
        ".config.yaml.*.tmp",
        "metrics.jsonl.tmp",
        ".metrics.jsonl.*.tmp",
    )
    for pattern in (*patterns, ".wandb_logged.json.*.tmp"):
        for tmp in Path(run_dir).glob(pattern):
            tmp.unlink(missing_ok=True)  # (unlink removes a symlink itself, never its target)
            removed.append(tmp)
    return removed
