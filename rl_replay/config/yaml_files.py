"""Config files as YAML: read with limits, parsed strictly, stacked on their ``base:`` files.

A config file is a regular file of at most :data:`MAX_CONFIG_BYTES`, UTF-8, parsed by a safe
YAML loader that also reads ``1e-3`` as a float, refuses a key given twice in one mapping
(naming the key and both lines) and refuses anchors and aliases. :func:`file_layers` reads a
file and the ``base:`` files below it. What the mappings mean is :mod:`rl_replay.config.loader`'s
business; every error here is a one-line ValueError (FileNotFoundError for a missing file).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from typing import Any

import yaml

from rl_replay.errors import one_line, shown

__all__ = [
    "ConfigYAMLError",
    "MAX_CONFIG_BYTES",
    "MAX_BASE_DEPTH",
    "yaml_load",
    "yaml_problem",
    "read_file",
    "parse",
    "file_layers",
    "key_text",
]


# --------------------------------------------------------------------------------------
# YAML: a safe loader that also reads 1e-3 as a float (PyYAML's YAML 1.1 resolver needs a
# dot), refuses a key given twice in one mapping (YAML would keep the last silently) and
# refuses anchors and aliases (a config has no use for them, and a few of them nest into a
# structure that grows exponentially when printed).
# --------------------------------------------------------------------------------------


class ConfigYAMLError(yaml.YAMLError):
    """A config's YAML is well-formed but not accepted (a duplicate key, an anchor or alias)."""


class _Loader(yaml.SafeLoader):
    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise ConfigYAMLError(
                f"line {event.start_mark.line + 1}: YAML anchors and aliases (&name, *name) are not "
                "accepted in a config; write the value out"
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, str] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                mark = key_node.start_mark
                where = f"{mark.line + 1}"
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: the constructor below names it
                    continue
                if first is not None:
                    both = f"lines {first} and {where}"
                    if first == where:  # both on one line: {a: 1, a: 2}
                        both = f"line {where}, columns {seen[key, 'column']} and {mark.column + 1}"
                    raise ConfigYAMLError(
                        f"key {shown(key)} is given twice in one mapping ({both}); "
                        "keep one (YAML would silently use the last)"
                    )
                seen[key], seen[key, "column"] = where, str(mark.column + 1)
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error on one line: what is wrong and where (PyYAML's own text spans several lines
    and quotes the source)."""
    if isinstance(exc, ConfigYAMLError):
        return str(exc)
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f"line {mark.line + 1} column {mark.column + 1}: " if mark is not None else ""
    return where + one_line(" ".join(str(problem).split()))[:200]


def key_text(key: Any) -> str:
    """A key as it appears in a message: a file's key may be anything (long, odd characters)."""
    return one_line(key) if isinstance(key, str) and len(key) <= 80 else shown(key)


#: A config is a page of YAML; a file far larger is not one (and is not read whole).
MAX_CONFIG_BYTES = 1 << 20


#: How many ``base:`` files a config may stand on.
MAX_BASE_DEPTH = 8


def read_file(path: str) -> bytes:
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"Config file not found: {path}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"Config file {path!r} is not a regular file; give the path of a YAML file")
    if info.st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"Config file {path!r} is {info.st_size} bytes; a config holds at most {MAX_CONFIG_BYTES}")
    with open(path, "rb") as fh:
        return fh.read(MAX_CONFIG_BYTES + 1)


def parse(text: str | bytes, source: str) -> Any:
    if len(text) > MAX_CONFIG_BYTES:
        raise ValueError(f"Config {source!r} is over {MAX_CONFIG_BYTES} bytes; a config holds at most that")
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return yaml_load(text)
    except UnicodeDecodeError as e:
        raise ValueError(f"Config file {source!r} is not UTF-8 text (byte {e.start})") from None
    except yaml.YAMLError as e:
        raise ValueError(f"Cannot parse config file {source!r} as YAML: {yaml_problem(e)}") from None
    except RecursionError:
        raise ValueError(f"Cannot parse config file {source!r} as YAML: it is nested too deeply") from None


def file_layers(path: str, below: tuple[str, ...]) -> list[tuple[Any, str]]:
    """``[(mapping, path), ...]`` of ``path`` and its ``base:`` files, the deepest base first."""
    loaded = parse(read_file(path), path)
    if not (isinstance(loaded, Mapping) and "base" in loaded):
        return [(loaded, path)]
    base = loaded["base"]
    if not isinstance(base, str) or not base:
        raise ValueError(f"Config key 'base' in {path!r} must be the path of another config file, got {shown(base)}")
    base_path = os.path.normpath(os.path.join(os.path.dirname(path), base))
    chain = (*below, os.path.realpath(path))
    if os.path.realpath(base_path) in chain:
        raise ValueError(f"Config {path!r} has base {base!r}, which is already below it: a base: cycle")
    if len(chain) > MAX_BASE_DEPTH:
        raise ValueError(f"Config {path!r}: more than {MAX_BASE_DEPTH} base: files below each other")
    rest = {k: v for k, v in loaded.items() if k != "base"}
    return [*file_layers(base_path, chain), (rest, path)]
