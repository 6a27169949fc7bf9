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
anyone, and importing a module runs it. The :class:`Importer` of such a config (passed explicitly
to whatever builds from it) imports only modules of :data:`FOREIGN_PACKAGES` (rl_replay and gymnasium,
already imported by then, so nothing is looked up on ``sys.path``: not in the run directory,
not in the current one); any other module, ``__main__`` included, is one line naming it and the
flag that trusts the config (docs/checkpoints.md, "The config trust rule").
"""

from __future__ import annotations

import importlib
import io
import pickle
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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
    "Importer",
    "OWN",
    "allowed_in_foreign_config",
    "foreign_refusal",
]

#: The packages whose modules a config this user did not sign may import.
FOREIGN_PACKAGES = ("rl_replay", "gymnasium")


def allowed_in_foreign_config(module: str) -> bool:
    """Whether a config this user did not sign may import ``module`` (old names mapped first)."""
    if not _MODULE.fullmatch(module):
        return False
    return current_module_name(module).partition(".")[0] in FOREIGN_PACKAGES


@dataclass(frozen=True)
class Importer:
    """What a config may import, passed to whatever builds from that config (envs, wrappers, agent).

    ``foreign`` is None for a config the user wrote or trusts: it may import anything. Otherwise
    it says why the config is foreign and how to trust it (one sentence), and only modules of
    :data:`FOREIGN_PACKAGES` are imported; any other is one line ending with that sentence.
    """

    foreign: str | None = None

    def import_module(self, module: str, what: str) -> ModuleType:
        """:func:`import_module`, refusing unimported a module a foreign config may not name."""
        if self.foreign is not None and isinstance(module, str) and not allowed_in_foreign_config(module):
            raise foreign_refusal(what, module, self.foreign)
        return import_module(module, what)

    def resolve(self, text: Any, what: str, short_names: Mapping[str, str] | None = None) -> Any:
        """:func:`resolve` through :meth:`import_module`."""
        return _resolve(text, what, short_names, self.import_module)


#: The importer of a config the user wrote (``--config``, a run's own signed config).
OWN = Importer()


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
        raise SetupError(f"{what} {shown(text)} must be a string {_FORM}.")
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

    Imports whatever it names: a config that is not the user's goes through :class:`Importer`.
    """
    if not isinstance(module, str) or not _MODULE.fullmatch(module):
        raise SetupError(f"{what}: {shown(module)} is not a module name (expected 'package.module').")
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
    return _resolve(text, what, short_names, import_module)


def _resolve(
    text: Any, what: str, short_names: Mapping[str, str] | None, importer: Callable[[str, str], ModuleType]
) -> Any:
    module_name, name = parse_target(_expand(text, what, short_names), what)
    module = importer(module_name, f"{what} {shown(text)}")
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
