"""A run's ``config.yaml``: signed by the run that wrote it, and data unless that signature is yours.

A config names code by import path (``agent.target``, ``env.wrappers[i].target``,
``env.imports``, an ``env.id`` of the form ``module:EnvId``), and importing a module runs it. A
run directory may come from anyone, so the run that writes ``config.yaml`` signs it: its first
line is a YAML comment holding an HMAC-SHA256 of the rest of the file, made with this user's
secret (:mod:`rl_replay.rundir.trust`, purpose ``config``)::

    # rl_replay config signature: key=<key id> hmac-sha256=<64 hex digits>
    seed: 1
    ...

:func:`read_run_config` reads the file (a regular file of at most 1 MiB, no symlink), parses the
bytes it verified and says whether it is this user's. A config that is not (another user's run,
a file edited since, a run written before configs were signed) is *foreign*: its targets are
checked by :func:`check_imports` before anything is built, and what builds from it imports through
its :class:`~rl_replay.targets.Importer`: nothing outside rl_replay and gymnasium; anything else is one
line naming the module and the flag that trusts the config (``--trust-config``). A config given
on the command line (``--config``) is the user's own and is not checked.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rl_replay.config import Config, dump_config, loads_config
from rl_replay.config.yaml_files import MAX_CONFIG_BYTES
from rl_replay.errors import shown
from rl_replay.registry import AGENTS
from rl_replay.rundir import files, trust
from rl_replay.targets import (
    allowed_in_foreign_config,
    foreign_refusal,
    is_short_name,
    parse_target,
    split_env_id,
)

__all__ = [
    "CONFIG_NAME",
    "RunConfig",
    "new_run_id",
    "write_run_config",
    "read_run_config",
    "check_imports",
]

CONFIG_NAME = "config.yaml"
_PREFIX = b"# rl_replay config signature: "
_SIGNATURE = re.compile(
    rb"# rl_replay config signature: key=([0-9a-f]{16})(?: run=([0-9a-f]{32}))? hmac-sha256=([0-9a-f]{64})"
)


def new_run_id() -> str:
    """A fresh run identity: 32 random hex digits, signed into the run's ``config.yaml``."""
    return secrets.token_hex(16)


def _signed(body: bytes, run_id: str | None) -> bytes:
    """What a config's MAC covers: its run identity (when it has one) and its YAML."""
    return body if run_id is None else b"run=" + run_id.encode() + b"\n" + body


@dataclass(frozen=True)
class RunConfig:
    """A run's config as read: ``cfg``; ``foreign``: None for this user's own (its signature
    verifies, or ``trust_config`` was given), else why it is not, with the flag that trusts it;
    ``run_id``: the run's identity as its signature names it (None: a config written before runs
    had one, or not this user's, whose word on it is not taken)."""

    cfg: Config
    foreign: str | None
    run_id: str | None = None


def write_run_config(cfg: Config, d: files.Dir, key: bytes, run_id: str | None = None) -> None:
    """Write ``config.yaml`` in the run directory ``d``, signed with ``key``, naming the run's identity ``run_id``
    (atomically; a symlink there is replaced).

    What is written must read back: the same limits apply as to a config read from a run.
    """
    body = dump_config(cfg)
    loads_config(body, (), source=f"the config written to {d.shown(CONFIG_NAME)}")
    mac = trust.sign(_signed(body.encode(), run_id), key, "config")
    run = f" run={run_id}" if run_id else ""
    line = f"{_PREFIX.decode()}key={trust.fingerprint(key)}{run} hmac-sha256={mac}\n"
    d.replace_with_text(CONFIG_NAME, line + body)


def _own(raw: bytes) -> tuple[bytes, str | None, str | None]:
    """``(YAML to parse, why it is foreign or None, run identity)``: the signed body when the
    signature is this user's (the run identity only then)."""
    first, newline, body = raw.partition(b"\n")
    match = _SIGNATURE.fullmatch(first) if newline else None
    if match is None:
        return raw, "it carries no signature: another user's run, or one written before configs were signed", None
    key = trust.existing_secret()
    run_id = match.group(2).decode() if match.group(2) else None
    if key is None or match.group(1).decode() != trust.fingerprint(key):
        return body, "it was signed by another user or machine", None
    if not trust.verify(_signed(body, run_id), match.group(3).decode(), key, "config"):
        return body, "it was changed after it was written", None
    return body, None, run_id


def read_run_config(
    run_dir: files.Dir | str | os.PathLike, overrides: Sequence[str] = (), *, trust_config: bool = False, flag: str
) -> RunConfig:
    """The config of the run in ``run_dir`` with ``overrides``, and whether it is this user's.

    ``flag`` is how the command trusts a foreign config (``--trust-config``), named in its
    refusals. Raises FileNotFoundError if there is no ``config.yaml``,
    :class:`~rl_replay.rundir.files.UnsafeFileError` if it is not a regular file of at most 1 MiB,
    and ValueError for a config that does not load.
    """
    if not isinstance(run_dir, files.Dir):
        with files.Dir.open(run_dir) as d:
            return read_run_config(d, overrides, trust_config=trust_config, flag=flag)
    path = run_dir.shown(CONFIG_NAME)
    raw = run_dir.read_regular(CONFIG_NAME, "config", limit=MAX_CONFIG_BYTES)
    text, why, run_id = _own(raw)
    cfg = loads_config(text, overrides, source=str(path))
    if why is None or trust_config:
        return RunConfig(cfg, None, run_id)
    return RunConfig(
        cfg,
        f"{path} is not this user's ({why}), so it may import only rl_replay and gymnasium modules. "
        f"If you trust its author and have read its targets, pass {flag}",
    )


def _named_modules(cfg: Config) -> Iterator[tuple[str, str]]:
    """``(key and value, module)`` of every module the config would import."""
    target = cfg.agent.target
    if not (is_short_name(target) and target in AGENTS):  # (an unknown short name is refused later)
        if not is_short_name(target):
            yield f"agent.target {shown(target)}", parse_target(target, "agent.target")[0]
    for i, spec in enumerate(cfg.env.wrappers):
        what = f"env.wrappers[{i}].target"
        yield f"{what} {shown(spec['target'])}", parse_target(spec["target"], what)[0]
    for i, name in enumerate(cfg.env.imports):
        yield f"env.imports[{i}]", name
    module, env_id = split_env_id(cfg.env.id)
    if module is not None:
        yield f"env.id {shown(cfg.env.id)}", module
    else:
        yield from _registered_targets(cfg.env.id, env_id)
    yield from _kwargs_targets("env.kwargs", cfg.env.kwargs)
    for i, spec in enumerate(cfg.env.wrappers):
        yield from _kwargs_targets(f"env.wrappers[{i}].kwargs", spec.get("kwargs") or {})


# A string value of the form ``package.module:Name``: what gymnasium's env makers import
# (``GymV26Environment-v0``'s ``env_id``, an entry point passed as a kwarg).
_TARGET_TEXT = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):[A-Za-z_][\w.-]*")


def _kwargs_targets(key: str, kwargs: Any, depth: int = 0) -> Iterator[tuple[str, str]]:
    """``(key and value, module)`` of every string in ``kwargs`` that names code by import path."""
    if depth > 32:
        return
    if isinstance(kwargs, str):
        match = _TARGET_TEXT.fullmatch(kwargs)
        if match:
            yield f"{key} {shown(kwargs)}", match.group(1)
    elif isinstance(kwargs, Mapping):
        for k, v in kwargs.items():
            yield from _kwargs_targets(f"{key}.{k}", v, depth + 1)
    elif isinstance(kwargs, (list, tuple)):
        for i, v in enumerate(kwargs):
            yield from _kwargs_targets(f"{key}[{i}]", v, depth + 1)


def _registered_targets(text: str, env_id: str) -> Iterator[tuple[str, str]]:
    """The modules a registered id's entry points and registered kwargs would import: an id that
    another package registered is code outside gymnasium and rl_replay, whatever its name says."""
    import gymnasium as gym

    import rl_replay.envs  # noqa: F401  (registers the project's own ids)

    spec = gym.registry.get(env_id)
    if spec is None:
        return  # refused later as an unknown id (importing nothing)
    for name, point in (("entry point", spec.entry_point), ("vector entry point", spec.vector_entry_point)):
        if isinstance(point, str):
            yield f"the {name} {shown(point)} of env.id {shown(text)}", point.partition(":")[0]
        elif point is not None:
            yield f"the {name} of env.id {shown(text)}", getattr(point, "__module__", None) or "?"
    yield from _kwargs_targets(f"the registered kwargs of env.id {shown(text)}", spec.kwargs or {})


def check_imports(run_config: RunConfig) -> None:
    """Refuse (one line) a foreign config that names a module outside rl_replay and gymnasium.

    Nothing is imported: this reads the names only, before anything is built.
    """
    if run_config.foreign is None:
        return
    for what, module in _named_modules(run_config.cfg):
        if not allowed_in_foreign_config(module):
            raise foreign_refusal(what, module, run_config.foreign)
