"""Checkpoints of older versions (pickles) rewritten in the current format, for files the user trusts.

Format 1 (``RLREPLAY-CHECKPOINT 1`` over a ``torch.save`` pickle) and bare ``torch.save`` files are
refused by every command (:mod:`rl_replay.rundir.checkpoint`) with the command that runs
:func:`convert_legacy`; this is the one place that still knows their layouts
(docs/checkpoints.md, "Migration from format 1").
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import torch

from rl_replay.errors import CheckpointError
from rl_replay.rundir import files
from rl_replay.rundir.checkpoint import CHECKPOINT_NAME, MAGIC, read_checkpoint_bytes, save_checkpoint
from rl_replay.rundir.config_file import read_run_config
from rl_replay.rundir.env_state_file import env_binding, save_env_state

__all__ = ["convert_legacy", "convert_in"]


def convert_legacy(path: str | os.PathLike, *, trust_file: bool, key: bytes) -> tuple[Path, Path | None]:
    """Rewrite a legacy (pickled) checkpoint as format 2; returns ``(checkpoint, kept original)``.

    Unpickles the file, so it runs whatever the file names: only with ``trust_file``. A run
    directory's ``checkpoint.pt`` and ``checkpoint.prev.pt`` are converted in place (each
    original kept as ``<name>.legacy``); the env pickles go to ``env_state.pkl``, signed with
    ``key``. A file that is already format 2 is left alone.
    """
    where = Path(path)
    if where.is_dir():
        d, name = files.Dir.open(where), CHECKPOINT_NAME
    else:
        d, name = files.open_parent(where)
    with d:
        return convert_in(d, name, trust_file=trust_file, key=key)


def convert_in(d: files.Dir, name: str, *, trust_file: bool, key: bytes) -> tuple[Path, Path | None]:
    """:func:`convert_legacy` of the checkpoint ``name`` in the held directory ``d``."""
    path = d.shown(name)
    if not d.exists(name):
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        read_checkpoint_bytes(d, name)
        return path, None  # already format 2
    except CheckpointError as exc:
        if "a pickle" not in str(exc):
            raise
    if not trust_file:
        raise CheckpointError(
            f"converting {path} unpickles it, which runs any code it names: pass --trust "
            "if you trust where it came from."
        )
    with d.open_regular(name, "checkpoint") as (f, size):
        files.check_affordable(size, path, "checkpoint")
        raw = f.read(size)
    if raw.startswith(MAGIC):
        line, _, data = raw.partition(b"\n")
        fields = files.header_fields(line, MAGIC + b"1 ", path, "checkpoint")
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
        # Bound to the run as its config.yaml names it (a run of that age names no identity).
        run_config = read_run_config(d, trust_config=True, flag="--trust")
        binding = env_binding(run_config.cfg.env, run_config.run_id)
        state["env_state"] = save_env_state(pickles, d, key, binding)
    kept = name + ".legacy"
    d.replace(name, kept)
    try:
        save_checkpoint(state, d, name)
    except BaseException:
        d.replace(kept, name)
        raise
    return path, d.shown(kept)
