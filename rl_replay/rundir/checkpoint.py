"""Checkpoint files that run no code when read, are written atomically and are never lost.

A checkpoint is two files (docs/operations.md, "Sharing runs"); this module is the first, the
second is :mod:`rl_replay.rundir.env_state_file`, and :mod:`rl_replay.rundir.legacy` converts the pickled
checkpoints of older versions:

* ``checkpoint.pt``: one header line, then a `safetensors` file holding every number of the
  run (weights, optimizer, counters, RNG states, collector arrays) with the tree's shape as
  JSON (:mod:`rl_replay.rundir.safe_tree`)::

      RLREPLAY-CHECKPOINT 2 sha256=<64 hex digits> size=<payload bytes>\\n
      <safetensors bytes>

  Reading it runs safetensors and json only, so a run directory from anyone can be
  evaluated or warm-started from.
* ``env_state.pkl`` (only for sync envs that pickle): the sub-envs pickled whole, which a
  resume needs to continue exactly. Its header adds an HMAC-SHA256 made with this user's
  secret (:mod:`rl_replay.rundir.trust`)::

      RLREPLAY-ENVSTATE 1 sha256=<hex> size=<bytes> key=<key id> hmac-sha256=<hex>\\n
      <safetensors bytes: one pickle per rank, as uint8>

  :func:`read_env_state` returns the pickles only when the MAC verifies (or the caller says it
  trusts the file); unpickling them is the resume's business. The checkpoint names the sha256
  of the env-state payload it belongs to, so a pair cut apart by a kill is never mixed.

Both are written the same way: to a temporary file in the same directory, fsynced, read back
and checked, the old file kept as ``<name>.prev<suffix>`` (``checkpoint.prev.pt``), then
renamed into place (``os.replace`` is atomic on POSIX). Loading opens a regular file only (no
symlink, FIFO or device: :mod:`rl_replay.rundir.files`), compares the file's size with the size its
header declares *before* reading the payload, reads exactly that many bytes (refused if this
process cannot hold them), checks the sha256 and raises a one-line
:class:`~rl_replay.errors.CheckpointError` naming the file for an empty, truncated, padded,
corrupt or foreign one; :func:`load_latest` falls back to the previous checkpoint.

Older checkpoints (format 1, or a bare ``torch.save``) are pickles: they are refused with the
command that converts one whose origin the user trusts (:func:`rl_replay.rundir.legacy.convert_legacy`).
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from rl_replay._compat import current_agent_keys
from rl_replay.errors import CheckpointError, one_line, shown
from rl_replay.rundir import files, safe_tree, shards

__all__ = [
    "CHECKPOINT_NAME",
    "PREVIOUS_NAME",
    "FORMAT",
    "save_checkpoint",
    "load_checkpoint",
    "load_latest",
    "checkpoint_path",
    "previous_checkpoint_path",
    "remove_stale_temporaries",
    "stale_temporaries",
    "non_finite_tensors",
    "require",
    "require_counts",
    "load_agent_weights",
    "finite_weights",
    "CONVERT_COMMAND",
    "MAGIC",
    "read_checkpoint_bytes",
]

CHECKPOINT_NAME = "checkpoint.pt"
PREVIOUS_NAME = "checkpoint.prev.pt"
FORMAT = 2
#: The start of every checkpoint's header line (the format number follows).
MAGIC = b"RLREPLAY-CHECKPOINT "
CONVERT_COMMAND = "python scripts/convert_checkpoint.py {path} --trust"


def checkpoint_path(run_dir: str | os.PathLike) -> Path:
    """Where a run keeps its latest checkpoint."""
    return Path(run_dir) / CHECKPOINT_NAME


def previous_checkpoint_path(run_dir: str | os.PathLike) -> Path:
    """Where a run keeps the checkpoint before the latest one."""
    return Path(run_dir) / PREVIOUS_NAME


# ------------------------------------------------------------------------- finite weights
def non_finite_tensors(state: dict[str, Any]) -> list[str]:
    """Names of the floating-point tensors in ``state`` holding NaN or infinity."""
    return [
        name
        for name, t in state.items()
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]


def _legacy_error(path: Path, kind: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} is {kind}: a pickle, which can run any code when loaded, so it is not loaded. "
        f"If you trust where it came from, convert it: {CONVERT_COMMAND.format(path=path)}"
    )


def _is_bare_torch_save(head: bytes) -> bool:
    # torch.save writes a zip archive (PK\x03\x04) or, with the legacy serializer, a pickle (0x80).
    return head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"


def read_checkpoint_bytes(d: files.Dir, name: str, *, display: Path | None = None, follow: bool = False) -> bytes:
    """The verified safetensors payload of the format-2 checkpoint ``name`` in ``d`` (``follow``:
    the user named the file and it may be a symlink; a run directory's own file may not)."""
    display = display or d.shown(name)
    with d.open_regular(name, "checkpoint", follow=follow) as (f, size):
        if size == 0:
            raise CheckpointError(f"checkpoint {display} is empty (0 bytes): it was cut off while being written.")
        head = f.read(len(MAGIC))
        if head != MAGIC:
            if _is_bare_torch_save(head):
                raise _legacy_error(display, "a bare torch.save file (no header)")
            raise CheckpointError(f"{display} is not an rl_replay checkpoint (it does not start with its header).")
        line = head + f.readline(files.HEADER_MAX)
        version, _, rest = line[len(MAGIC) :].partition(b" ")
        if version == b"1":
            raise _legacy_error(display, "in the format-1 layout")
        if version != str(FORMAT).encode():
            raise CheckpointError(
                f"checkpoint {display} has format {one_line(version.decode(errors='replace'))[:20]!r}, which this "
                f"version of rl_replay does not read (it reads format {FORMAT}); upgrade rl_replay."
            )
        fields = files.header_fields(b" " + rest, b"", display, "checkpoint")
        return files.read_payload(f, size, line, fields, display, "checkpoint")


# ---------------------------------------------------------------------------- checkpoints
def save_checkpoint(payload: dict[str, Any], where: files.Dir | str | os.PathLike, name: str | None = None) -> None:
    """Verify, write and rename ``payload`` into a checkpoint; keep the old file as the previous one.

    ``where`` is a held run directory (``name``: ``checkpoint.pt`` unless given) or a file's path.
    ``payload`` is a tree :mod:`rl_replay.rundir.safe_tree` stores (no arbitrary objects). Raises
    :class:`CheckpointError` (and writes nothing) if ``payload["agent"]`` holds a non-finite
    tensor: a diverged model must never replace the last good checkpoint.
    """
    with files.located(where, CHECKPOINT_NAME, name) as (d, leaf, _):
        path = d.shown(leaf)
        bad = non_finite_tensors(payload.get("agent", {}))
        if bad:
            raise CheckpointError(
                f"refusing to write {path}: agent weights {', '.join(bad[:4])}"
                f"{' ...' if len(bad) > 4 else ''} are not finite; the previous checkpoint is kept."
            )
        data = safe_tree.dumps(payload, {"format": f"rl_replay-checkpoint-{FORMAT}"})
        header = MAGIC + f"{FORMAT} sha256={hashlib.sha256(data).hexdigest()} size={len(data)}\n".encode()
        d.write_atomic(leaf, header, data, lambda tmp: read_checkpoint_bytes(d, tmp, display=path))


def _decode(data: bytes, path: Path, d: files.Dir) -> dict[str, Any]:
    try:
        state, _ = safe_tree.loads(data, budget=files.memory_left() // 2)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read: {exc}.") from None
    if isinstance(state, dict) and isinstance(state.get("agent"), dict):
        state = shards.assemble(d, state, path)  # a sharded checkpoint's tensors, read from their files
    if not isinstance(state, dict) or not isinstance(state.get("agent"), dict):
        raise CheckpointError(f"{path} is not an rl_replay checkpoint (it holds no agent weights).")
    odd = [k for k, v in state["agent"].items() if not isinstance(v, torch.Tensor)]
    if odd:
        raise CheckpointError(
            f"checkpoint {path} is not an rl_replay checkpoint: its agent entries "
            f"{', '.join(map(repr, odd[:4]))} are not tensors."
        )
    return state


def load_checkpoint(
    where: files.Dir | str | os.PathLike, name: str | None = None, *, follow: bool = False
) -> dict[str, Any]:
    """Load and verify a checkpoint onto the CPU: ``name`` (default ``checkpoint.pt``) of a held run
    directory, a run directory's latest, or a file the user named (which may be a symlink).

    Runs no code from the file. Raises FileNotFoundError if it does not exist,
    :class:`~rl_replay.rundir.files.UnsafeFileError` if it is not a regular file (a symlink in a
    run directory too) and :class:`CheckpointError` (one line, naming the file) if it is empty,
    truncated, corrupt, not a checkpoint, or a legacy pickle (with the command that converts a
    trusted one).
    """
    with files.located(where, CHECKPOINT_NAME, name) as (d, leaf, user_named):
        if not d.exists(leaf):
            raise FileNotFoundError(f"no checkpoint at {d.shown(leaf)}")
        return _decode(read_checkpoint_bytes(d, leaf, follow=follow or user_named), d.shown(leaf), d)


def finite_weights(state: dict[str, Any], path: str | os.PathLike) -> dict[str, Any]:
    """``state``'s agent weights, refused (one :class:`CheckpointError` line naming ``path`` and the
    first tensors) unless every one is finite: a diverged run's weights are never used."""
    bad = non_finite_tensors(state["agent"])
    if bad:
        raise CheckpointError(
            f"checkpoint {path} holds non-finite agent weights ({', '.join(bad[:4])}"
            f"{' ...' if len(bad) > 4 else ''}): a diverged run. Use a checkpoint written before it diverged."
        )
    return state["agent"]


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


def load_latest(where: files.Dir | str | os.PathLike) -> tuple[dict[str, Any], Path, str | None]:
    """The run's latest readable checkpoint: ``(state, path, warning)``.

    Falls back to ``checkpoint.prev.pt`` when ``checkpoint.pt`` is missing or damaged;
    ``warning`` then says so (None otherwise). Raises the latest file's error if neither loads.
    """
    with files.located(where, CHECKPOINT_NAME) as (d, _, _):
        try:
            return load_checkpoint(d, CHECKPOINT_NAME), d.shown(CHECKPOINT_NAME), None
        except (CheckpointError, FileNotFoundError) as exc:
            if not d.exists(PREVIOUS_NAME):
                raise
            try:
                state = load_checkpoint(d, PREVIOUS_NAME)
            except CheckpointError:
                raise exc from None
            previous = d.shown(PREVIOUS_NAME)
            return (
                state,
                previous,
                f"{exc} Resuming from the previous checkpoint {previous} (update {state.get('update')}).",
            )


#: The temporary files a write that was killed leaves (checkpoint, env state, config, metrics, wandb mark).
STALE_PATTERNS = (
    ".checkpoint*.tmp*",
    ".env_state*.tmp*",
    ".config.yaml.*.tmp",
    "metrics.jsonl.tmp",
    ".metrics.jsonl.*.tmp",
    ".wandb_logged.json.*.tmp",
    ".tensorboard_logged.json.*.tmp",
)


def stale_temporaries(d: files.Dir) -> list[str]:
    """The names of the temporaries a killed write left in ``d``; refuses (one line, naming it) one
    that is not a regular file or a symlink: nothing this project writes, so not removed blindly."""
    found = []
    for name in sorted(d.listdir()):
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in STALE_PATTERNS):
            info = d.lstat(name)
            if info is not None and not (stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode)):
                raise files.UnsafeFileError(
                    f"{d.shown(name)} has the name of a temporary file a killed write leaves, but it is "
                    f"{files.kind_of(info.st_mode)}: remove it (it is not rl_replay's) and try again."
                )
            found.append(name)
    return found


def remove_stale_temporaries(where: files.Dir | str | os.PathLike) -> list[Path]:
    """Delete temporary files left by a checkpoint (or env state, config, metrics) write that was killed.

    Returns the files removed. Call it only while holding the run directory's lock (no other
    writer is active); one that is not a file is refused first (:func:`stale_temporaries`).
    """
    removed = []
    with files.held(where) as d:
        for name in stale_temporaries(d):
            d.unlink(name, missing_ok=True)  # (unlink removes a symlink itself, never its target)
            removed.append(d.shown(name))
    return removed


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
