"""The env-state file: the pickles a resume needs, unpickled only when this user signed them.

``env_state.pkl`` (only for sync envs that pickle) holds the sub-envs pickled whole, which a
resume needs to continue exactly. Its header adds an HMAC-SHA256 made with this user's secret
(:mod:`rl_replay.run.trust`)::

    RLREPLAY-ENVSTATE 1 sha256=<hex> size=<bytes> key=<key id> hmac-sha256=<hex>\\n
    <safetensors bytes: one pickle per rank, as uint8>

:func:`read_env_state` returns the pickles only when the MAC verifies (or the caller says it
trusts the file); unpickling them is the resume's business. The checkpoint names the sha256 of
the env-state payload it belongs to, so a pair cut apart by a kill is never mixed. It is written
and read as the checkpoint is (:mod:`rl_replay.run.files`: atomic, no symlink, bounded reads).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from rl_replay.errors import CheckpointError, one_line
from rl_replay.run import files, safe_tree, trust

__all__ = ["ENV_STATE_NAME", "save_env_state", "read_env_state", "EnvState"]

ENV_STATE_NAME = "env_state.pkl"
_ENV_MAGIC = b"RLREPLAY-ENVSTATE 1 "


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
    files.write_atomic(path, header, data, lambda tmp: _read_env_file(tmp, shown=path))
    return digest


def _read_env_file(path: Path, *, shown: Path | None = None) -> tuple[dict[str, str], bytes]:
    shown = shown or path
    with files.open_regular(path, "env state") as (f, size):
        head = f.read(len(_ENV_MAGIC))
        if head != _ENV_MAGIC:
            raise CheckpointError(f"env state {shown} is not an rl_replay env-state file.")
        line = head + f.readline(files.HEADER_MAX)
        fields = files.header_fields(line, _ENV_MAGIC, shown, "env state")
        return fields, files.read_payload(f, size, line, fields, shown, "env state")


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
    for path in (latest, files.previous_path(latest)):
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
            pickles, _ = safe_tree.loads(data, budget=files.memory_left() // 2)
        except ValueError as exc:
            return EnvState(None, f"{path} cannot be read ({exc})")
        if not isinstance(pickles, list) or not all(p is None or isinstance(p, bytes) for p in pickles):
            return EnvState(None, f"{path} does not hold env pickles")
        return EnvState(pickles, note)
    detail = f" ({problems[0]})" if problems else ""
    return EnvState(None, f"no env-state file of this checkpoint in {run_dir}{detail}")
