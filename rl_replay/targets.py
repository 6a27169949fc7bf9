"""Import targets in configs: ``module:Name`` strings, parsed and resolved in one place.

One grammar serves every config key that names code:

* ``package.module:Name`` (or ``package.module.Name``): the attribute ``Name`` of the module
  (``agent.target``, ``env.wrappers[i].target``);
* a bare ``name`` where the key has a table of short names (``agent.target: gru``);
* ``package.module:EnvId-v0`` for ``env.id`` (gymnasium's own form: import the module, which
  registers the id, then make the id); ``env.imports`` lists bare module names.

Old module names that configs and pickles already hold (``agents.gru:GRUAgent``) resolve to
the modules' current names (:mod:`rl_replay._compat`).

Errors are :class:`~rl_replay.errors.SetupError` (a ``ValueError``), one line of the form
``<key> '<value>': <what is wrong>``. Parsing imports nothing, so :mod:`rl_replay.config`
checks the grammar without loading the trainer side.

**Foreign configs.** A run's ``config.yaml`` that this user's key did not sign may come from
anyone, and importing a module runs it. While :func:`foreign_config` is in effect,
:func:`import_module` imports only modules of :data:`FOREIGN_PACKAGES` (rl_replay and gymnasium,
already imported by then, so nothing is looked up on ``sys.path``: not in the run directory,
not in the current one); any other module, ``__main__`` included, is one line naming it and the
flag that trusts the config (docs/checkpoints.md, "The config trust rule").
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import io
import pickle
import re
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any

from rl_replay._compat import current_module_name
from rl_replay.errors import SetupError, one_line, shown

__all__ = [
    "parse_target",
    "split_env_id",
    "is_short_name",
    "current_module_name",
    "import_module",
    "resolve",
    "canonical_target",
    "unpickle",
    "FOREIGN_PACKAGES",
    "foreign_config",
    "allowed_in_foreign_config",
    "foreign_refusal",
    "foreign_why",
]

#: The packages whose modules a config this user did not sign may import.
FOREIGN_PACKAGES = ("rl_replay", "gymnasium")

# Set while a foreign config is being used: why it is foreign and how to trust it (one sentence).
_FOREIGN: contextvars.ContextVar[str | None] = contextvars.ContextVar("rl_replay_foreign_config", default=None)


def allowed_in_foreign_config(module: str) -> bool:
    """Whether a config this user did not sign may import ``module`` (old names mapped first)."""
    if not _MODULE.fullmatch(module):
        return False
    return current_module_name(module).partition(".")[0] in FOREIGN_PACKAGES


@contextlib.contextmanager
def foreign_config(why: str) -> Iterator[None]:
    """Within this block :func:`import_module` refuses modules outside :data:`FOREIGN_PACKAGES`;
    ``why`` ends the refusal (why the config is foreign, and the flag that trusts it)."""
    token = _FOREIGN.set(why)
    try:
        yield
    finally:
        _FOREIGN.reset(token)


def foreign_why() -> str | None:
    """Why the config in use is foreign (None: it is the user's own, or none is in use)."""
    return _FOREIGN.get()


def foreign_refusal(what: str, module: str, why: str) -> SetupError:
    """The one line refusing ``module`` named by a foreign config's key ``what``."""
    return SetupError(f"{what} names module {shown(module)}, which is not part of rl_replay or gymnasium; {why}")


_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_FORM = "'package.module:Name' (or 'package.module.Name')"


def is_short_name(text: str) -> bool:
    """True for a bare name such as ``gru`` (no module part), looked up in a table of names."""
    return text.isidentifier()


def parse_target(text: Any, what: str) -> tuple[str, str]:
    """``package.module:Name`` or ``package.module.Name`` -> ``(module, name)``.

    ``what`` names the config key in the error, e.g. ``"env.wrappers[0].target"``.
    """
    if not isinstance(text, str):
        raise SetupError(f"{what} {text!r} must be a string {_FORM}.")
    if ":" in text:
        module, _, name = text.partition(":")
    else:
        module, _, name = text.rpartition(".")
    if not (_MODULE.fullmatch(module) and name.isidentifier()):
        raise SetupError(f"{what} {shown(text)} must look like {_FORM}.")
    return module, name


def split_env_id(env_id: str) -> tuple[str | None, str]:
    """``package.module:EnvId-v0`` -> ``(module, "EnvId-v0")``; a plain id -> ``(None, id)``."""
    if ":" not in env_id:
        return None, env_id
    module, _, name = env_id.partition(":")
    if not (_MODULE.fullmatch(module) and name):
        raise SetupError(f"env.id {shown(env_id)} must look like 'package.module:EnvId-v0' or a registered id.")
    return module, name


def import_module(module: str, what: str) -> ModuleType:
    """Import ``module`` (old top-level names mapped to their new ones); one-line SetupError.

    Under :func:`foreign_config`, a module outside :data:`FOREIGN_PACKAGES` is refused unimported.
    """
    if not isinstance(module, str) or not _MODULE.fullmatch(module):
        raise SetupError(f"{what}: {shown(module)} is not a module name (expected 'package.module').")
    why = _FOREIGN.get()
    if why is not None and not allowed_in_foreign_config(module):
        raise foreign_refusal(what, module, why)
    try:
        return importlib.import_module(current_module_name(module))
    except ImportError as exc:
        raise SetupError(f"{what}: cannot import module '{module}' ({one_line(str(exc))[:200]}).") from None


def _expand(text: Any, what: str, short_names: Mapping[str, str] | None) -> str:
    """A short name replaced by the target it stands for; anything else unchanged."""
    if short_names is None or not isinstance(text, str) or not is_short_name(text):
        return text
    if text not in short_names:
        raise SetupError(
            f"{what} {shown(text)} is not a built-in name (one of {', '.join(sorted(short_names))}); "
            f"name your own class as {_FORM}."
        )
    return short_names[text]


def resolve(text: Any, what: str, short_names: Mapping[str, str] | None = None) -> Any:
    """The object a target names: a short name from ``short_names``, or ``module:Name``."""
    module_name, name = parse_target(_expand(text, what, short_names), what)
    module = import_module(module_name, f"{what} {shown(text)}")
    obj = getattr(module, name, None)
    if obj is None:
        raise SetupError(f"{what} {shown(text)}: module '{module.__name__}' has no attribute '{name}'.")
    return obj


def canonical_target(text: Any, short_names: Mapping[str, str] | None = None) -> Any:
    """``module:Name`` with the module's current name: targets that name the same object
    compare equal (``gru``, ``agents.gru:GRUAgent``, ``rl_replay.agents.gru.GRUAgent``).

    Text that is not a valid target is returned unchanged.
    """
    try:
        module, name = parse_target(_expand(text, "target", short_names), "target")
        return f"{current_module_name(module)}:{name}"
    except (SetupError, ImportError):
        return text


class _RenamedModulesUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return super().find_class(current_module_name(module), name)


def unpickle(data: bytes) -> Any:
    """``pickle.loads`` that also reads pickles written before the rename: a checkpoint's
    pickled ``envs.memory.MemoryCueEnv`` loads as ``rl_replay.envs.memory.MemoryCueEnv``."""
    return _RenamedModulesUnpickler(io.BytesIO(data)).load()
