"""The env-state file: the pickles a resume needs, unpickled only when this user signed them.

``env_state.pkl`` (only for sync envs that pickle) holds the sub-envs pickled whole, which a
resume needs to continue exactly. Its header adds an HMAC-SHA256 made with this user's secret
(:mod:`rl_replay.rundir.trust`)::

    RLREPLAY-ENVSTATE 2 sha256=<hex> size=<bytes> key=<key id> hmac-sha256=<hex>\\n
    <safetensors bytes: one pickle per rank, as uint8>

The MAC covers the payload and what it belongs to (:func:`env_binding`): the run's identity,
signed into its ``config.yaml``, and its env config. An env state of another run of this user's,
or of other envs, does not verify, whatever an edited checkpoint names.

:func:`read_env_state` returns the pickles only when the MAC verifies (or the caller says it
trusts the file); unpickling them is the resume's business. The checkpoint names the sha256 of
the env-state payload it belongs to, so a pair cut apart by a kill is never mixed. It is written
and read as the checkpoint is (:mod:`rl_replay.rundir.files`: atomic, no symlink, bounded reads).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from rl_replay.errors import CheckpointError, one_line
from rl_replay.rundir import files, safe_tree, trust

__all__ = ["ENV_STATE_NAME", "env_binding", "run_binding", "save_env_state", "read_env_state", "EnvState"]

ENV_STATE_NAME = "env_state.pkl"
_ENV_MAGIC = b"RLREPLAY-ENVSTATE 2 "
_UNBOUND_MAGIC = b"RLREPLAY-ENVSTATE 1 "  # written before env states were bound to their run


def env_binding(env: Any, run_id: str | None) -> bytes:
    """What an env state belongs to, covered by its MAC: the run's identity and its env config
    (id, kwargs, wrappers, number of envs, ...). ``env`` is the config's ``env`` section."""
    section = dataclasses.asdict(env) if dataclasses.is_dataclass(env) and not isinstance(env, type) else dict(env)
    return json.dumps({"run": run_id, "env": section}, sort_keys=True, default=repr).encode()


def run_binding(run_dir: files.Dir | str | os.PathLike) -> bytes:
    """:func:`env_binding` of the run in ``run_dir`` as its ``config.yaml`` names it (read as data)."""
    from rl_replay.rundir.config_file import read_run_config

    run_config = read_run_config(run_dir, trust_config=True, flag="--trust-config")
    return env_binding(run_config.cfg.env, run_config.run_id)


def save_env_state(pickles: list[bytes | None], d: files.Dir, key: bytes, binding: bytes) -> str:
    """Write the per-rank env pickles as ``env_state.pkl`` in the run directory ``d`` with a MAC
    under ``key`` over them and ``binding`` (:func:`env_binding`: the run and env config they
    belong to).

    Returns the sha256 of the payload, which the checkpoint records to name its env state.
    """
    path = d.shown(ENV_STATE_NAME)
    data = safe_tree.dumps(list(pickles), {"format": "rl_replay-env-state-2"})
    digest = hashlib.sha256(data).hexdigest()
    mac = trust.sign(_bound(binding, data), key)
    header = _ENV_MAGIC + f"sha256={digest} size={len(data)} key={trust.fingerprint(key)} hmac-sha256={mac}\n".encode()
    d.write_atomic(ENV_STATE_NAME, header, data, lambda tmp: _read_env_file(d, tmp, display=path))
    return digest


def _bound(binding: bytes, data: bytes) -> bytes:
    return len(binding).to_bytes(8, "little") + binding + data


def _read_env_file(d: files.Dir, name: str, *, display: Path | None = None) -> tuple[dict[str, str], bytes]:
    display = display or d.shown(name)
    with d.open_regular(name, "env state") as (f, size):
        head = f.read(len(_ENV_MAGIC))
        if head == _UNBOUND_MAGIC:
            raise CheckpointError(
                f"env state {display} was written before env states were bound to their run, so it is not "
                "taken as this run's"
            )
        if head != _ENV_MAGIC:
            raise CheckpointError(f"env state {display} is not an rl_replay env-state file.")
        line = head + f.readline(files.HEADER_MAX)
        fields = files.header_fields(line, _ENV_MAGIC, display, "env state")
        return fields, files.read_payload(f, size, line, fields, display, "env state")


class EnvState:
    """What :func:`read_env_state` found: ``pickles`` (one per rank) or None, and ``note``: why
    they are not given (None when they are), or the risk taken when trusted against the MAC."""

    def __init__(self, pickles: list[bytes | None] | None, note: str | None = None) -> None:
        self.pickles, self.note = pickles, note


def read_env_state(
    run_dir: files.Dir | str | os.PathLike, digest: str, key: bytes, binding: bytes, *, trust_file: bool = False
) -> EnvState:
    """The env pickles a checkpoint names (by payload sha256 ``digest``), if they may be unpickled.

    They are returned when the file's HMAC verifies under ``key`` over them and ``binding``
    (this user wrote them, for this run and this env config: :func:`env_binding`), or,
    with ``trust_file``, whatever the MAC says (``note`` then names the risk). Otherwise
    ``pickles`` is None and ``note`` says why: no such file, damaged, written by another
    user or machine, or changed after it was written. Nothing here unpickles.
    """
    if not isinstance(run_dir, files.Dir):
        with files.Dir.open(run_dir) as d:
            return read_env_state(d, digest, key, binding, trust_file=trust_file)
    d = run_dir
    problems = []
    for name in (ENV_STATE_NAME, files.previous_name(ENV_STATE_NAME)):
        path = d.shown(name)
        if not d.exists(name):
            continue
        try:
            fields, data = _read_env_file(d, name)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        if fields.get("sha256") != digest:
            continue
        mine = fields.get("key") == trust.fingerprint(key)
        if trust.verify(_bound(binding, data), fields.get("hmac-sha256", ""), key, "env-state"):
            note = None
        else:
            why = (
                "written for another run or env config, or changed since (its MAC does not verify with this "
                "user's key for this run's identity and env config)"
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
    return EnvState(None, f"no env-state file of this checkpoint in {d.path}{detail}")
